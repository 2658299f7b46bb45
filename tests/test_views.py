"""Pure view functions on canned traces: every origin and verdict appears, text is escaped."""

import copy

from conftest import decode, perturbed, tiny_model

from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.trace import ORIGINS, VERDICTS, DraftToken, EmittedToken, Step, Trace
from mtp_viz.viz import figures
from mtp_viz.viz.style import ORIGIN_COLOURS, VERDICT_COLOURS
from mtp_viz.viz.tables import metrics_table, summary_html
from mtp_viz.viz.tokens import step_detail_html, tokens_html

XSS = "<img src=x onerror=alert(1)>"


def canned_trace(temperature: float = 0.7) -> Trace:
    """Hand-made steps covering every origin and verdict, with hostile token texts."""
    steps = [
        Step(0, [EmittedToken(10, "autoregressive", 0.9, "Hello")]),
        Step(
            1,
            [EmittedToken(11, "accepted", 0.8, XSS), EmittedToken(12, "resampled", 0.4, "\n\tcode")],
            drafted=[
                DraftToken(11, "draft_model", 0.7, XSS),
                DraftToken(13, "draft_model", 0.6, "<b>no</b>"),
                DraftToken(14, "draft_model", 0.5, "&amp;"),
            ],
            verdicts=["accepted", "rejected", "skipped"],
            target_p=[0.8, 0.1, 0.2],
            draws=[0.3, 0.9, None],
            draft_s=0.01,
            verify_s=0.02,
            step_s=0.031,
            target_forwards=1,
            draft_forwards=3,
        ),
        Step(
            2,
            [EmittedToken(15, "accepted", 0.7, " a"), EmittedToken(16, "bonus", 0.6, '"q"')],
            drafted=[DraftToken(15, "ngram", 1.0, " a")],
            verdicts=["accepted"],
            target_p=[0.7],
            draws=[0.2],
            target_forwards=1,
        ),
        Step(3, [EmittedToken(17, "unverified", None, "'", confidence=0.95)], target_forwards=1),
    ]
    return Trace(
        strategy="speculative",
        model="m",
        draft_model="d",
        settings={"temperature": temperature},
        prompt_token_ids=[1, 2],
        output_token_ids=[10, 11, 12, 15, 16, 17],
        steps=steps,
        wall_time_s=0.5,
        stop_reason="max_new_tokens",
    )


def test_canned_trace_covers_every_origin_and_verdict():
    t = canned_trace()
    t.check()
    assert {e.origin for s in t.steps for e in s.emitted} == set(ORIGINS)
    assert {v for s in t.steps for v in s.verdicts} == set(VERDICTS)


def test_token_view_shows_every_origin_and_strikes_dropped_drafts():
    page = tokens_html(canned_trace().steps)
    for origin in ORIGINS:
        assert ORIGIN_COLOURS[origin] in page
    assert page.count('class="mv-tok mv-drop rejected"') == 1 and page.count("mv-drop skipped") == 1
    assert page.count('class="mv-step') == 4
    assert "↵" in page and "→" in page  # newline and tab made visible


def test_token_view_escapes_token_text():
    page = tokens_html(canned_trace().steps) + step_detail_html(canned_trace(), 1)
    assert "<img" not in page and "<b>no</b>" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "&amp;amp;" in page  # a literal "&amp;" token stays literal


def test_rejected_draft_is_shown_where_it_was_proposed():
    page = tokens_html(canned_trace().steps[1:2])
    accepted, rejected, resampled = (
        page.index(marker)
        for marker in ('class="mv-tok accepted"', 'class="mv-tok mv-drop rejected"', 'class="mv-tok resampled"')
    )
    assert accepted < rejected < resampled


def test_hover_details_carry_p_q_and_the_draw():
    page = tokens_html(canned_trace().steps)
    assert "q (draft) = 0.600" in page and "p (target) = 0.100" in page and "min(1, p/q) = 0.167" in page
    assert "draw u = 0.900" in page and "step 1" in page


def test_step_detail_explains_each_verdict():
    detail = step_detail_html(canned_trace(), 1)
    assert "u = 0.900 ≥ min(1, p/q) = 0.167: thrown away" in detail
    assert "not judged" in detail
    greedy = step_detail_html(canned_trace(temperature=0.0), 1)
    assert "argmax is a different token" in greedy


def series(fig) -> dict:
    return {d.name: (list(d.x), [round(v, 6) for v in d.y]) for d in fig.data}


def test_figures_draw_what_the_trace_holds():
    trace = canned_trace()
    timeline = series(figures.step_timeline(trace))
    assert timeline["drafting"][1] == [0.0, 10.0, 0.0, 0.0]  # ms, step 1 only is timed
    assert timeline["verifying (target forward)"][1] == [0.0, 20.0, 0.0, 0.0]
    assert timeline["other"][1] == [0.0, 1.0, 0.0, 0.0]  # 31 ms − 10 − 20
    assert timeline["tokens drafted"][1] == [0, 3, 1, 0] and timeline["tokens emitted"][1] == [1, 2, 2, 1]
    # position 1: accepted in steps 1 and 2; position 2 rejected; position 3 skipped after it
    assert series(figures.position_acceptance(trace))[None] == ([1, 2, 3], [1.0, 0.0, 0.0])
    assert series(figures.accepted_length_histogram(trace))[None] == ([1, 2], [2, 2])  # two 1-token, two 2-token steps
    probs = figures.step_probabilities(trace, 1)
    assert series(probs)["q (draft)"][1] == [0.7, 0.6, 0.5] and series(probs)["p (target)"][1] == [0.8, 0.1, 0.2]
    assert list(probs.data[1].marker.line.color) == [VERDICT_COLOURS[v] for v in ("accepted", "rejected", "skipped")]
    for fig in (figures.step_timeline(trace), probs):
        assert "<img" not in fig.to_json()  # token texts escaped


def test_figures_from_a_real_run():
    model = tiny_model("llama-2l")
    _, steps = decode(
        model,
        "speculative",
        [5, 6, 7],
        GenerationSettings(max_new_tokens=20),
        draft=perturbed(model, 0.2),
        num_draft_tokens=3,
    )
    trace = copy.deepcopy(canned_trace())
    trace.steps = steps
    trace.output_token_ids = [e.token_id for s in steps for e in s.emitted]
    timeline = figures.step_timeline(trace)
    assert len(timeline.data[0].x) == len(steps)
    rates = figures.position_acceptance(trace).data[0].y
    assert list(rates) == trace.summary["per_position_acceptance"]


def test_metrics_table_and_summary():
    base = canned_trace()
    fast = copy.deepcopy(base)
    fast.wall_time_s = 0.25
    table = metrics_table([base, fast], baseline=base)
    assert list(table["speedup"]) == [1.0, 2.0]
    assert "speedup vs autoregressive" in summary_html(fast, base.summary["tokens_per_s"])
    assert "2.00x" in summary_html(fast, base.summary["tokens_per_s"])


def test_walkthrough_lights_up_each_phase_of_a_step():
    from mtp_viz.viz.tokens import PHASES, walkthrough_html

    trace = canned_trace()
    rejected, bonus = trace.steps[1], trace.steps[2]
    pages = {phase: walkthrough_html(rejected, phase) for phase in PHASES}
    assert pages["draft"].count("mv-tok mv-focus") == 3 and "guesses 3 tokens" in pages["draft"]
    assert pages["accept / reject"].count("mv-tok mv-focus") == 2  # judged: the kept one and the refused one
    assert "1 of 3 guesses are kept" in pages["accept / reject"]
    assert "resampled" in pages["bonus / resample"] and "code" in pages["bonus / resample"]
    assert "bonus token" in walkthrough_html(bonus, "bonus / resample")
    assert pages["commit"].count("mv-tok mv-focus") == 2 and "commits 2 tokens" in pages["commit"]
    assert all(XSS not in page and "<b>no</b>" not in page for page in pages.values())  # escaped
    assert "Nothing was drafted" in walkthrough_html(trace.steps[0], "draft")
