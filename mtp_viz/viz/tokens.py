"""Trace → token view HTML: each token coloured by origin, rejected drafts struck through where
they were proposed, step boundaries visible, details on hover. Every string is escaped."""

import html

from mtp_viz.trace import VERDICT_ACCEPTED, VERDICT_REJECTED, DraftToken, EmittedToken, Step, Trace
from mtp_viz.viz.style import ORIGIN_COLOURS, ORIGIN_LABELS, REJECTED_COLOUR, SKIPPED_COLOUR, VERDICT_COLOURS

UNKNOWN_MARK = "?"  # a drafted token whose id the engine did not report
UNREPORTED_DRAFT = "which token: not reported by the engine (only how many were drafted)"
NEWLINE_MARK = "↵"
TAB_MARK = "→"


def visible(text: str) -> str:
    """Escaped token text with newlines and tabs marked but kept (pre-wrap keeps them real)."""
    if text == "":
        return '<span class="mv-empty">∅</span>'  # e.g. the first half of a split character
    out = html.escape(text, quote=True)
    out = out.replace("\n", f'<span class="mv-ws">{NEWLINE_MARK}</span>\n')
    out = out.replace("\t", f'<span class="mv-ws">{TAB_MARK}</span>\t')
    return out


def ms(seconds: float | None) -> str:
    return "time not reported" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _ratio(p: float | None, q: float | None) -> str:
    if p is None or q is None or q <= 0:
        return "—"
    return f"{min(1.0, p / q):.3f}"


def is_tree(step: Step) -> bool:
    return any(d.parent is not None for d in step.drafted)


def draft_tooltip(step: Step, i: int) -> str:
    d: DraftToken = step.drafted[i]
    where = f"node {i + 1}, depth {step.depths[i]}" if is_tree(step) else f"draft #{i + 1}"
    parts = [
        f"step {step.index}",
        f"{where} ({d.source})",
        f"verdict: {step.verdicts[i]}",
        f"q (draft) = {_fmt(d.q)}",
        f"p (target) = {_fmt(step.target_p[i])}",
        f"min(1, p/q) = {_ratio(step.target_p[i], d.q)}",
    ]
    if step.draws[i] is not None:
        parts.append(f"draw u = {step.draws[i]:.3f}")
    parts.append(f"token id {d.token_id}" if d.token_id is not None else UNREPORTED_DRAFT)
    return " · ".join(parts)


def draft_text(d: DraftToken) -> str:
    """A drafted token's text, or a mark where the engine reported that it drafted, not what."""
    return UNKNOWN_MARK if d.token_id is None else d.text


def emitted_tooltip(step: Step, e: EmittedToken, draft_index: int | None) -> str:
    if draft_index is not None:
        return draft_tooltip(step, draft_index)
    parts = [f"step {step.index}", ORIGIN_LABELS[e.origin], f"p (target) = {_fmt(e.p)}"]
    if e.confidence is not None:
        parts.append(f"confidence = {e.confidence:.3f}")
    parts.append(f"token id {e.token_id}")
    return " · ".join(parts)


def _span(text: str, colour: str, tooltip: str, classes: str) -> str:
    return (
        f'<span class="mv-tok {classes}" style="background:{colour}" '
        f'title="{html.escape(tooltip, quote=True)}">{visible(text)}</span>'
    )


def step_html(step: Step, selected: bool = False) -> str:
    """One step: kept tokens, then the thrown-away drafts struck through, then the target's token.
    In a token tree only the refused candidates are shown inline (the replay panel has the tree)."""
    parts = []
    accepted = [i for i, v in enumerate(step.verdicts) if v == VERDICT_ACCEPTED]
    emitted = list(step.emitted)
    for i, e in zip(accepted, emitted, strict=False):
        parts.append(_span(e.text, ORIGIN_COLOURS[e.origin], emitted_tooltip(step, e, i), e.origin))
    tree = is_tree(step)
    for i, v in enumerate(step.verdicts):
        if v != VERDICT_ACCEPTED and not (tree and v != VERDICT_REJECTED):
            colour = REJECTED_COLOUR if v == VERDICT_REJECTED else SKIPPED_COLOUR
            parts.append(_span(draft_text(step.drafted[i]), colour, draft_tooltip(step, i), f"mv-drop {v}"))
    for e in emitted[len(accepted) :]:
        parts.append(_span(e.text, ORIGIN_COLOURS[e.origin], emitted_tooltip(step, e, None), e.origin))
    cls = "mv-step mv-selected" if selected else "mv-step"
    return f'<span class="{cls}" data-step="{step.index}">{"".join(parts)}</span>'


TOKEN_CSS = """
.mv-tokens{white-space:pre-wrap;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:14px;
  line-height:1.9;color:#111827}
.mv-tok{border-radius:3px;padding:1px 0;margin:0 1px 0 0}
.mv-drop{text-decoration:line-through;text-decoration-thickness:2px;opacity:.8}
.mv-drop.skipped{opacity:.45}
.mv-step{border-left:2px solid #9ca3af;padding-left:2px;margin-left:1px}
.mv-selected{outline:2px solid #111827;outline-offset:1px}
.mv-ws{color:#6b7280}
.mv-empty{color:#9ca3af;font-size:10px}
.mv-legend span{display:inline-block;border-radius:3px;padding:0 6px;margin:2px 6px 2px 0;font-size:12px}
"""


def legend_html() -> str:
    items = [
        f'<span style="background:{ORIGIN_COLOURS[o]}">{html.escape(label)}</span>'
        for o, label in ORIGIN_LABELS.items()
    ]
    items.append(f'<span style="background:{REJECTED_COLOUR};text-decoration:line-through">rejected draft</span>')
    items.append(f'<span style="background:{SKIPPED_COLOUR};text-decoration:line-through">never judged</span>')
    return f'<div class="mv-legend">{"".join(items)}</div>'


def tokens_html(steps: list[Step], selected: int | None = None, prompt: str | None = None) -> str:
    """The whole token view; `selected` outlines one step (the replay slider)."""
    body = "".join(step_html(s, s.index == selected) for s in steps)
    head = f'<span class="mv-prompt" style="color:#6b7280">{visible(prompt)}</span>' if prompt else ""
    return f'<style>{TOKEN_CSS}</style>{legend_html()}<div class="mv-tokens">{head}{body}</div>'


def _why(step: Step, i: int, greedy: bool) -> str:
    v, p, q, u = step.verdicts[i], step.target_p[i], step.drafted[i].q, step.draws[i]
    if v == "skipped":
        return "not judged: an earlier draft was rejected (or EOS / the token budget came first)"
    if greedy:
        return (
            "the target's argmax is this token" if v == VERDICT_ACCEPTED else "the target's argmax is a different token"
        )
    keep = _ratio(p, q)
    if v == VERDICT_ACCEPTED:
        return f"u = {_fmt(u)} < min(1, p/q) = {keep}: kept"
    return f"u = {_fmt(u)} ≥ min(1, p/q) = {keep}: thrown away"


def tree_html(step: Step) -> str:
    """The step's token tree, one node a line, indented by depth; the accepted path in bold."""
    children: dict[int, list[int]] = {}
    for i, d in enumerate(step.drafted):
        children.setdefault(
            -1 if d.parent is None and i == 0 else (i - 1 if d.parent is None else d.parent), []
        ).append(i)
    lines = []

    def walk(node: int, depth: int) -> None:
        for c in children.get(node, []):
            d, v = step.drafted[c], step.verdicts[c]
            label = f"{visible(d.text)} <small>({html.escape(v)}, p = {_fmt(step.target_p[c])})</small>"
            if v == VERDICT_ACCEPTED:
                label = f"<b>{label}</b>"
            colour = VERDICT_COLOURS.get(v, SKIPPED_COLOUR)
            lines.append(
                f'<div style="margin-left:{1.5 * depth}em"><span style="background:{colour}">└</span> {label}</div>'
            )
            walk(c, depth + 1)

    walk(-1, 0)
    head = "<p><b>Token tree</b> (children of the last emitted token first):</p>"
    return f"{head}<div class='mv-tree'>{''.join(lines)}</div>"


def confidence_html(step: Step) -> str:
    """ConfAdapt: the k predictions' confidences against τ; the emitted prefix was not verified."""
    tau = step.extra.get("tau")
    cells = "".join(
        f"<td style='background:{ORIGIN_COLOURS['unverified'] if i < len(step.emitted) else SKIPPED_COLOUR}'>"
        f"{c:.3f}</td>"
        for i, c in enumerate(step.extra["confidence"])
    )
    return (
        f"<p>{len(step.extra['confidence'])} predictions from one forward; confidence (top-1 probability) of each, "
        f"τ = {_fmt(tau)}. The emitted prefix (coloured) was not checked by the target.</p>"
        f"<table class='mv-detail'><tr>{cells}</tr></table>"
    )


def step_detail_html(trace: Trace, index: int) -> str:
    """The replay panel: every drafted token with q, p, the rule's numbers and its verdict, then
    what the step emitted and why."""
    step = trace.steps[index]
    greedy = trace.settings.get("temperature", 0.0) == 0.0
    e = html.escape
    rows = "".join(
        f"<tr><td>{i + 1}</td><td><code>{visible(draft_text(d))}</code></td><td>{e(d.source)}</td><td>{_fmt(d.q)}</td>"
        f"<td>{_fmt(step.target_p[i])}</td><td>{_ratio(step.target_p[i], d.q)}</td>"
        f"<td>{_fmt(step.draws[i])}</td><td>{e(step.verdicts[i])}</td><td>{e(_why(step, i, greedy))}</td></tr>"
        for i, d in enumerate(step.drafted)
    )
    drafted = (
        "<table class='mv-detail'><tr><th>#</th><th>token</th><th>source</th><th>q draft</th><th>p target</th>"
        f"<th>min(1, p/q)</th><th>draw u</th><th>verdict</th><th>why</th></tr>{rows}</table>"
        if step.drafted
        else "<p>Nothing was drafted in this step: the target ran one ordinary forward.</p>"
    )
    if is_tree(step):
        drafted += tree_html(step)
    if "confidence" in step.extra:  # an unverified multi-token step (ConfAdapt)
        drafted = confidence_html(step)
    emitted = ", ".join(
        f"<code>{visible(t.text)}</code> ({e(ORIGIN_LABELS[t.origin])}, p = {_fmt(t.p)})" for t in step.emitted
    )
    timing = (
        f"drafting {ms(step.draft_s)}, verifying {ms(step.verify_s)}, step {ms(step.step_s)}; "
        f"{step.input_tokens} tokens fed to the target, KV cache {step.kv_len} long"
    )
    style = (
        "<style>.mv-detail{border-collapse:collapse;font-size:13px}.mv-detail td,.mv-detail th"
        "{border:1px solid #e5e7eb;padding:2px 6px;white-space:pre-wrap}"
        ".mv-scroll{overflow-x:auto;max-width:100%}</style>"  # a wide table scrolls in its column
    )
    return (
        f"{style}<h4>Step {step.index} of {len(trace.steps) - 1}</h4><div class='mv-scroll'>{drafted}</div>"
        f"<p><b>Emitted:</b> {emitted or 'nothing'}</p><p>{e(timing)}</p>"
    )


# A guided walk through one step, for teaching: each phase lights up the step's own tokens.
PHASES = ("draft", "verify", "accept / reject", "bonus / resample", "commit")
WALK_CSS = ".mv-walk .mv-tok{opacity:.3}.mv-walk .mv-focus{opacity:1;outline:2px solid #111827;outline-offset:1px}"


def walkthrough_html(step: Step, phase: str) -> str:
    """One step at one phase of draft → verify → accept/reject → bonus/resample → commit: the
    step's drafted and emitted tokens, those the phase is about outlined, and one sentence."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    n, kept = len(step.drafted), step.accepted
    finisher = step.emitted[-1] if step.emitted and len(step.emitted) > kept else None
    drafts = []
    for i, d in enumerate(step.drafted):
        colour = {"draft": SKIPPED_COLOUR, "verify": SKIPPED_COLOUR}.get(phase, VERDICT_COLOURS[step.verdicts[i]])
        focus = phase in ("draft", "verify") or (phase == "accept / reject" and step.verdicts[i] != "skipped")
        focus = focus or (phase == "commit" and step.verdicts[i] == VERDICT_ACCEPTED)
        drafts.append(_span(draft_text(d), colour, draft_tooltip(step, i), "mv-focus" if focus else ""))
    tail = ""
    if finisher is not None and phase in ("bonus / resample", "commit"):
        tail = _span(finisher.text, ORIGIN_COLOURS[finisher.origin], emitted_tooltip(step, finisher, None), "mv-focus")
    source = step.drafted[0].source if n else ""
    if not n:
        sentence = (
            "Nothing was drafted in this step: the target ran one ordinary forward and produced one token "
            f"({ms(step.verify_s)}). Pick a step with drafts to walk through speculation."
        )
    elif phase == "draft":
        sentence = f"The drafter ({source}) guesses {n} token{'s' * (n != 1)} cheaply, in {ms(step.draft_s)}."
    elif phase == "verify":
        sentence = (
            f"The target scores the last token and all {n} guesses in one forward ({ms(step.verify_s)}): "
            "p, its probability for each guess, is on hover."
        )
    elif phase == "accept / reject":
        sentence = (
            f"{kept} of {n} guesses are kept (green); the first one the target refuses (red) ends the block, "
            "and guesses after it are never judged."
        )
    elif phase == "bonus / resample":
        if finisher is None:
            sentence = "The output ended inside the block (EOS or the token budget), so no extra token follows."
        elif kept == n:
            sentence = "Every guess was kept, so the target's own next token after them comes free: the bonus token."
        else:
            sentence = (
                "At the refused position the target puts its own token instead (resampled from what is left of "
                "its distribution), so the step still makes progress."
            )
    else:
        sentence = (
            f"The step commits {len(step.emitted)} token{'s' * (len(step.emitted) != 1)} for one target forward; "
            f"the KV cache keeps only their entries (now {step.kv_len} long)."
        )
    tokens = "".join(drafts) + tail
    return (
        f"<style>{TOKEN_CSS}{WALK_CSS}</style><div class='mv-walk'><b>Step {step.index}: "
        f"{html.escape(phase)}</b><div class='mv-tokens'>{tokens}</div><p>{html.escape(sentence)}</p></div>"
    )
