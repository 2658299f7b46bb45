"""A newcomer's first look, in a real browser (Debian's chromium via Playwright): the page opens on
Explore's recorded example, its speedup measured and the controls holding its settings, without
loading a model; each tab, opened by a click as a user would, draws figures that hold points; and
only the Deploy? tab, which prices its strategies from their loaded models, loads one, when opened.
The app runs in this process, so the model loader itself is watched. Screenshots and the measured
first paint land in test-artifacts/."""

import importlib.util
import re
import shutil
import time
from pathlib import Path

import pytest
from app_registry import SHIPPED_MODEL, registry_with_shipped_model
from optional import require

from mtp_viz.loading import pipeline
from mtp_viz.machine import machine_label
from mtp_viz.paths import CACHE_ENV
from mtp_viz.registry import REGISTRY_ENV
from mtp_viz.ui.deploy_tab import price_results
from mtp_viz.ui.first_look import FIRST_LOOK, open_example
from mtp_viz.ui.results import example_traces

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
CHROMIUM_FLAGS += ["--disable-sync", "--no-first-run", "--disable-quic"]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
pytestmark = pytest.mark.slow

# Each tab's figures before anything is run (Compare's are drawn by a comparison), and the tabs
# that load a model when opened, by design: Deploy? prices each strategy from its loaded models.
DEFAULT_FIGURES = {"Explore": 4, "Compare": 0, "Theory": 2, "Benchmark": 4, "Deploy?": 2}
LOADS_WHEN_OPENED = {"Deploy?"}
WAIT_MS = 60_000
# points from plotly's own traces (_fullData): `data` keeps what was sent, and a numpy column arrives as
# a typed-array spec ({dtype, bdata}) with no length, which would count as neither empty nor full
POINTS_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot'))
  .filter(p => p.offsetParent !== null)
  .map(p => ({
    title: String((p.layout && p.layout.title && (p.layout.title.text || p.layout.title)) || '(untitled)'),
    points: (p._fullData || []).reduce(
      (n, t) => n + Math.max(...['x', 'y', 'z', 'values'].map(k => (t[k] || []).length)), 0),
  }))"""
VISIBLE_FIGURES_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot'))
  .filter(p => p.offsetParent !== null && p._fullData).length"""  # shown and drawn


@pytest.fixture(scope="module", autouse=True)
def browser_installed():
    """Checked before the app is served (autouse fixtures come first)."""
    require(shutil.which(CHROMIUM) is not None, f"Debian's chromium ({CHROMIUM})", "bash scripts/setup.sh --browser")
    require(importlib.util.find_spec("playwright") is not None, "Playwright", "bash scripts/setup.sh")


@pytest.fixture(scope="module")
def app(tiny_registry, tmp_path_factory):
    """The whole app on a free local port, in this process: the tiny models (one under the shipped
    results' model name) and a cache of its own."""
    from mtp_viz.ui.app import build_app

    folder = tmp_path_factory.mktemp("app")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(REGISTRY_ENV, str(registry_with_shipped_model(tiny_registry, folder)))
        env.setenv(CACHE_ENV, str(folder / "cache"))
        served = build_app().queue()
        served.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
        try:
            yield served
        finally:
            served.close()


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """The models the loader is asked for from now on (every load passes through pipeline.load)."""
    asked = []
    load = pipeline.load

    def watched(spec):
        asked.append(spec.name)
        return load(spec)

    monkeypatch.setattr(pipeline, "load", watched)
    pipeline.forget()  # a model, or a price, an earlier test had must be asked for again
    price_results.cache_clear()
    return asked


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


def settle(app, stable_s: float = 1.0, timeout_s: float = 120.0) -> None:
    """Wait until the app has no event queued or running, `stable_s` on end: every handler a page
    load or a click started has finished (a hidden one included)."""
    deadline = time.monotonic() + timeout_s
    idle_since = None
    while time.monotonic() < deadline:
        busy = len(app._queue) > 0 or app._queue.get_active_worker_count() > 0
        idle_since = None if busy else (idle_since or time.monotonic())
        if idle_since is not None and time.monotonic() - idle_since >= stable_s:
            return
        time.sleep(0.1)
    pytest.fail(f"the app was still busy after {timeout_s} s")


def open_first_look(browser, app) -> tuple:
    """A fresh page on the app, once Explore's recorded example is drawn: (page, seconds it took)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    start = time.monotonic()
    page.goto(app.local_url)
    page.wait_for_selector("#mv-first-look .mv-first-look", timeout=WAIT_MS)
    page.wait_for_selector("#mv-token-view .mv-tok", timeout=WAIT_MS)
    page.wait_for_function(f"() => ({VISIBLE_FIGURES_JS})() >= {DEFAULT_FIGURES['Explore']}", timeout=WAIT_MS)
    return page, time.monotonic() - start


def test_a_page_load_draws_the_first_look_and_loads_no_model(app, loads, browser):
    """The first look is drawn from its trace; the other tabs, hidden, do nothing until opened."""
    page, first_paint_s = open_first_look(browser, app)
    settle(app)
    assert loads == [], f"a page load asked the loader for {loads}"
    ARTIFACTS.joinpath("first-paint.txt").write_text(f"{first_paint_s:.2f} s from navigation to the drawn first look\n")
    print(f"first paint: {first_paint_s:.2f} s")


def test_the_first_look_shows_its_speedup_and_its_own_settings(app, browser):
    page, _ = open_first_look(browser, app)
    summary = page.locator("#mv-summary").inner_text()
    assert re.search(r"speedup vs autoregressive\s*\d+\.\d\dx", summary), summary
    example = open_example(FIRST_LOOK, example_traces()).trace
    note = page.locator("#mv-first-look").inner_text()
    assert f"recorded beside it on the same machine ({machine_label(example.machine)}" in note, note
    assert page.locator("#mv-strategy input").input_value() == example.strategy == "mtp_heads"
    assert page.get_by_text("Chain length (tree = chain)").is_visible()  # the heads' own settings, shown
    assert page.locator("#mv-prompt textarea").input_value() == example.prompt_text
    page.screenshot(path=str(ARTIFACTS / "first-look-tabs.png"), full_page=True)


def test_each_tab_opens_on_figures_that_hold_points_and_loads_only_by_design(app, loads, browser):
    page, _ = open_first_look(browser, app)
    settle(app)
    for tab in DEFAULT_FIGURES:
        asked = len(loads)
        page.get_by_role("tab", name=tab).click()
        wanted = DEFAULT_FIGURES[tab]
        page.wait_for_function(f"() => ({VISIBLE_FIGURES_JS})() >= {wanted}", timeout=WAIT_MS)
        settle(app)
        figures = page.evaluate(POINTS_JS)
        assert len(figures) == wanted, f"{tab} opens on {len(figures)} figures, not {wanted}: {figures}"
        empty = [f["title"] for f in figures if f["points"] == 0]
        assert not empty, f"{tab} opens on figures with no points: {empty}"
        opened = loads[asked:]
        if tab in LOADS_WHEN_OPENED:
            assert opened and set(opened) <= {SHIPPED_MODEL}, opened  # the shipped results' model, to price
        else:
            assert opened == [], f"opening {tab} asked the loader for {opened}"
        page.screenshot(path=str(ARTIFACTS / f"opened-{tab.strip('?').lower()}.png"), full_page=True)
