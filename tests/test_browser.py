"""A real browser (Debian's chromium via Playwright) drives the app: type, Run, see coloured tokens
and the timeline, scrub a step, no error toast; an uploaded hostile trace injects no element.
Screenshots land in test-artifacts/. Skipped without chromium and Playwright, except in CI, where
their absence fails (tests/optional.py)."""

import importlib.util
import re
import shutil
import time
from pathlib import Path

import pytest
from conftest import wait_until_idle
from optional import require

from mtp_viz.trace import Trace

CHROMIUM = "/usr/bin/chromium"
WAIT_MS = 60_000  # the longest a page is given to draw what a test waits for
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def browser_installed():
    """Checked before the app is served (autouse fixtures come first)."""
    require(shutil.which(CHROMIUM) is not None, f"Debian's chromium ({CHROMIUM})", "bash scripts/setup.sh --browser")
    require(importlib.util.find_spec("playwright") is not None, "Playwright", "bash scripts/setup.sh")


@pytest.fixture
def page(served_blocks, served_app):
    """A fresh page on the app once Explore's first look is drawn and its handler has ended, so
    nothing a test does is overwritten by that first paint."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
            ],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        alerts = []
        page.on("dialog", lambda d: (alerts.append(d.message), d.dismiss()))
        page.alerts = alerts
        page.goto(served_app)
        page.wait_for_selector("#mv-first-look .mv-first-look", timeout=WAIT_MS)
        page.wait_for_selector("#mv-token-view .mv-tok", timeout=WAIT_MS)
        wait_until_idle(served_blocks)
        page.served = served_blocks
        yield page
        browser.close()


def _no_error_toast(page) -> None:
    assert page.locator(".toast-body.error, [data-testid='toast-body'].error").count() == 0
    assert page.get_by_text("Error", exact=True).count() == 0


def _wait_for_own_run(page) -> None:
    """Explore opens on a recorded example; wait until the run replaced it (note gone, our model shown)."""
    page.wait_for_selector("#mv-first-look .mv-first-look", state="detached", timeout=120_000)
    page.wait_for_selector("#mv-summary :text('prompt_lookup · tiny'), #mv-summary :text('· tiny')", timeout=120_000)


def test_first_look_is_a_drawn_example(page):
    """Before any Run, Explore shows a recorded example: tokens, timeline and replay, and says so."""
    assert "recorded example" in page.locator("#mv-first-look").inner_text()
    assert page.locator("#mv-token-view .mv-tok").count() > 3
    assert len(_settled_figures(page, "Explore")) >= 3
    page.screenshot(path=str(ARTIFACTS / "first-look.png"), full_page=True)


def test_run_stream_scrub(page):
    page.locator("#mv-strategy input").click()
    page.get_by_role("option", name="prompt_lookup").click()
    page.wait_for_selector("text=Shortest n-gram", timeout=10_000)  # its own parameters appear
    prompt = page.locator("#mv-prompt textarea")
    prompt.fill("the cat sat on the mat and the cat sat on the")
    page.get_by_role("button", name="Run", exact=True).click()
    _wait_for_own_run(page)
    page.wait_for_selector("text=/Step [0-9]+ of/", timeout=60_000)  # the replay opens on the first step that drafted
    summary = page.locator("#mv-summary").inner_text()
    assert "prompt_lookup · tiny" in summary
    assert re.search(r"speedup vs autoregressive\s*\d+\.\d\dx", summary), summary  # measured, no extra click
    assert "against the autoregressive run" in summary
    assert page.locator("#mv-token-view .mv-tok").count() > 3
    assert page.locator("#mv-token-view .mv-tok.accepted").count() > 0  # drafts were copied and kept
    slider = page.locator("#mv-step-slider input[type='number']")
    slider.fill("2")
    slider.press("Enter")
    page.wait_for_selector("text=Step 2 of", timeout=30_000)
    assert page.locator("#mv-token-view .mv-selected[data-step='2']").count() == 1
    page.locator("#mv-phase").get_by_text("accept / reject").click()  # the guided walk through step 2
    page.wait_for_selector("#mv-walk :text('Step 2: accept / reject')", timeout=30_000)
    walk = page.locator("#mv-walk").inner_text()
    assert "guesses are kept" in walk or "Nothing was drafted" in walk, walk
    _no_error_toast(page)
    page.screenshot(path=str(ARTIFACTS / "explore.png"), full_page=True)


def test_uploaded_trace_with_markup_tokens_injects_nothing(page, tmp_path):
    from test_views import XSS, canned_trace

    trace: Trace = canned_trace()
    path = tmp_path / "hostile.json"
    trace.save(path)
    page.locator("input[type='file']").last.set_input_files(str(path))
    page.wait_for_function(  # the upload replaced the example Explore opened on
        "text => document.querySelector('#mv-token-view').innerText.includes(text)", arg=XSS, timeout=30_000
    )
    assert page.locator("#mv-token-view img").count() == 0
    assert page.locator("#mv-token-view b").count() == 0
    assert XSS in page.locator("#mv-token-view").inner_text()
    assert page.alerts == []
    page.screenshot(path=str(ARTIFACTS / "hostile-trace.png"), full_page=True)


def test_compare_tab(page):
    page.get_by_role("tab", name="Compare").click()
    page.get_by_role("button", name="Compare", exact=True).click()
    page.wait_for_selector("#mv-verdicts li", timeout=90_000)
    verdicts = page.locator("#mv-verdicts").inner_text()
    assert "prompt_lookup: identical to autoregressive" in verdicts
    assert "speculative: identical to autoregressive" in verdicts
    page.get_by_role("button", name="Run the distribution check").click()
    page.wait_for_selector("#mv-dist-verdict b", timeout=120_000)
    assert "vs the exact target distribution: p =" in page.locator("#mv-dist-verdict").inner_text()
    _no_error_toast(page)
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)


def test_generated_markup_tokens_inject_nothing(page):
    """A model that writes tokens like <img src=x onerror=alert(1)>: they show as text, and no
    element is injected and no script runs, in the token view or anywhere on the page."""
    from conftest import MARKUP

    page.locator("#mv-model input").click()
    page.get_by_role("option", name="Markup tokens").click()
    page.locator("#mv-strategy input").click()
    page.get_by_role("option", name="autoregressive", exact=True).click()
    page.locator("#mv-prompt textarea").fill("say <script>alert(3)</script> and <img src=y onerror=alert(4)>")
    page.get_by_role("button", name="Run", exact=True).click()
    _wait_for_own_run(page)
    page.wait_for_selector("text=/Step [0-9]+ of/", timeout=60_000)  # the replay opens on the first step that drafted
    shown = page.locator("#mv-token-view").inner_text()
    assert any(m in shown for m in MARKUP), shown  # the model did write markup
    assert page.locator("img[src='x'], img[src='y']").count() == 0
    assert page.locator("#mv-token-view script, #mv-token-view b, #mv-token-view img").count() == 0
    assert page.alerts == []
    _no_error_toast(page)
    page.screenshot(path=str(ARTIFACTS / "markup-tokens.png"), full_page=True)


def test_theory_measures_this_machine_and_labels_the_curve(page, tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path))  # no cached measurement: measured now
    page.get_by_role("tab", name="Theory").click()
    page.get_by_role("button", name="Measure this machine").click()
    page.wait_for_selector("#mv-measure-status :text('drawn beside the chosen one')", timeout=90_000)
    page.wait_for_selector("text=(this machine)", timeout=30_000)  # the legend names the new curve
    _no_error_toast(page)
    page.screenshot(path=str(ARTIFACTS / "theory-measured.png"), full_page=True)


FIGURES_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot'))
  .filter(p => p.offsetParent !== null)
  .map(p => {
    const frame = p.parentElement.getBoundingClientRect();
    const svg = (p.querySelector('.main-svg') || p).getBoundingClientRect();
    const title = p.querySelector('.gtitle');
    return {title: title ? title.textContent : '', right: svg.right, left: svg.left, frameRight: frame.right,
            frameLeft: frame.left, legend: p.querySelectorAll('.legend .traces').length, page: window.innerWidth};
  })"""
WIDE_HTML_JS = """() => Array.from(document.querySelectorAll('.mv-detail'))
  .filter(e => e.offsetParent !== null)
  .map(e => e.closest('.mv-scroll') || e)
  .filter(e => e.getBoundingClientRect().right >
               (e.closest('.block') || document.body).getBoundingClientRect().right + 2)
  .map(e => e.className || e.tagName)"""
TABS = ("Explore", "Compare", "Theory", "Benchmark", "Deploy?")
OPENS_WITHOUT_FIGURES = {"Compare"}  # its figures are drawn by a comparison
SETTLE_LOOK_MS = 400  # between two looks at a tab's figures
# points from plotly's own traces (_fullData): `data` keeps what was sent, and a numpy column arrives as
# a typed-array spec ({dtype, bdata}) with no length; NaN while a figure is not drawn yet
POINTS_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot'))
  .filter(p => p.offsetParent !== null)
  .map(p => ({
    title: String((p.layout && p.layout.title && (p.layout.title.text || p.layout.title)) || '(untitled)'),
    points: (p._fullData || []).reduce((n, t) => n + Math.max((t.x || []).length, (t.y || []).length), 0)
      + (p._fullData ? 0 : NaN),
  }))"""


def test_every_tab_opens_on_figures_that_hold_data(page):
    """Before any run, each tab's default views (the recorded first look, the shipped results and
    profiles) draw points: no figure a newcomer sees first is empty."""
    for tab in TABS:
        page.get_by_role("tab", name=tab).click()
        figures = _settled_figures(page, tab)
        assert bool(figures) == (tab not in OPENS_WITHOUT_FIGURES), f"{tab} opens on {len(figures)} figures"
        points = page.evaluate(POINTS_JS)
        assert len(points) == len(figures), (tab, points, figures)
        empty = [f["title"] for f in points if f["points"] == 0]
        assert not empty, f"{tab} opens on figures with no data: {empty}"


def _settled_figures(page, tab: str, timeout_s: float = 30.0) -> list:
    """The shown tab's figures once drawn and laid out: every handler the app was running has
    ended (a tab's opening draws its figures), every one has its traces (plotly's own), and two looks a
    frame batch apart agree (plotly lays a plot out again after its tab shows). Fails when they never settle."""
    wait_until_idle(page.served)
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        figures = page.evaluate(FIGURES_JS)
        drawn = all(f["points"] == f["points"] for f in page.evaluate(POINTS_JS))  # NaN: not drawn yet
        if figures == last and drawn:
            return figures
        last = figures
        page.wait_for_timeout(SETTLE_LOOK_MS)
    pytest.fail(f"{tab}: the figures were still changing after {timeout_s:.0f} s: {last}", pytrace=False)


@pytest.mark.parametrize("width", [1400, 900])
def test_every_tab_is_readable_after_a_run(page, width):
    """A laptop and a projector: after a run, every tab's figures fit their frames and the page,
    and no legend lists more than the cap. Screenshots of each tab land in test-artifacts/."""
    from mtp_viz.viz.figures import MAX_SERIES

    page.set_viewport_size({"width": width, "height": 1600})
    page.get_by_role("button", name="Run", exact=True).click()
    _wait_for_own_run(page)
    for tab in TABS:
        page.get_by_role("tab", name=tab).click()
        if tab == "Compare":
            page.get_by_role("button", name="Compare", exact=True).click()
            page.wait_for_selector("#mv-verdicts li", timeout=90_000)
        figures = _settled_figures(page, tab)
        assert figures, f"{tab}: no figure drawn"
        for f in figures:
            assert f["right"] <= min(f["frameRight"], f["page"]) + 2 and f["left"] >= f["frameLeft"] - 2, (tab, f)
            assert f["legend"] <= MAX_SERIES, (tab, f)
        wide = page.evaluate(WIDE_HTML_JS)  # HTML panels (the replay table) stay inside their column
        assert not wide, (tab, wide)
        _no_error_toast(page)
        page.screenshot(path=str(ARTIFACTS / f"tab-{tab.strip('?').lower()}-{width}.png"), full_page=True)
