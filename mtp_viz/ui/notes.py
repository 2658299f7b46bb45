"""Short "what you are seeing" notes, written for a student, one per view."""

TOKENS = """**What you are seeing.** Every token of the answer, coloured by where it came from. Grey tokens
came from an ordinary forward pass of the big (target) model. Green tokens were *guessed* by a cheap
drafter and then *checked* by the target, and the target agreed. Crossed-out red tokens were guessed and
thrown away. The orange token after them is the target's own choice at that point. A blue **bonus** token
comes free when every guess in a step is accepted. Each thin bar on the left marks a new step, that is,
one forward pass of the target. Hover over a token to see its probabilities."""

TIMELINE = """**What you are seeing.** One bar per step: the time spent drafting (purple) and verifying (blue).
The lines show how many tokens were guessed and how many came out. Speculative decoding pays off when
the drafting is cheap and many guesses survive. Then one expensive forward yields several tokens."""

ACCEPTANCE = """**What you are seeing.** Left: how often the 1st, 2nd, 3rd... guessed token was accepted. Later
positions can only be accepted if every earlier one was, so the bars usually fall. Right: how many tokens
each target forward produced. Plain decoding always produces 1."""

REPLAY = """**What you are seeing.** One step at a time. For each guessed token, q is how sure the drafter was
and p is how likely the target finds it. When sampling, the token is kept if a random draw u falls below
min(1, p/q). At the first rejection the target draws a replacement from what is left of its distribution,
norm(max(0, p − q)). Because of that rule, the output follows the target's distribution exactly."""

COMPARE = """**What you are seeing.** The same prompt and settings through several strategies, one after the
other on the same machine. Speedup is tokens/s divided by autoregressive tokens/s. A lossless strategy
must produce exactly the autoregressive tokens under greedy decoding. If it does not, the first place
where they differ is diagnosed."""

DISTRIBUTION = """**What you are seeing.** Each sampler draws the first token many times. If speculative sampling
is lossless, its histogram matches plain sampling, apart from noise. The chi-square test puts a number
on "apart from noise"."""

THEORY = """**What you are seeing.** Leviathan et al.'s prediction for speculative decoding. If each drafted
token is accepted with chance α, a draft of γ tokens yields (1 − α^(γ+1)) / (1 − α) tokens per target
forward. If one draft forward costs c target forwards, the speedup is that divided by (γc + 1). The
textbook assumes that verifying γ+1 tokens costs one ordinary forward. On a GPU that is nearly
true for dozens of tokens; on a CPU a few tokens already cost more and a dozen about twice as
much. Dashed curves use a measured verify cost, each labelled with the machine it was measured
on: the shipped one, and yours once you press **Measure this machine** (or upload the JSON of
`python -m mtp_viz profile`). Diamonds are your own runs: their α, γ and c come from their traces,
their speedup from the autoregressive run of the same prompt. Where they sit below the curves, the
difference is what the formula leaves out."""

EXITS = """**Why an untrained early exit accepts so little.** `self_speculative` drafts with the model's
first L layers and its own final norm and head. The bars show, per exit layer L, how often that
shortcut picks the same next token as the whole model (measured by `python -m mtp_viz profile` on
greedy answers to Spec-Bench prompts). Under greedy decoding a drafted token is accepted exactly
when they agree, so a draft of γ tokens keeps about a + a² + … + a^γ of them, with a the bar's
height. The middle layers have not yet formed the answer, and only the last few layers agree often;
but an exit that late saves little time. A trained exit adapter, or a separate trained draft,
is how to buy agreement cheaply."""

BENCH = """**What you are seeing.** A benchmark over Spec-Bench prompts (`python -m mtp_viz bench`), with
autoregressive decoding measured in the same run as the baseline of every speedup. Lossless
strategies must reproduce autoregressive output (agreement 1). Lossy ones (ConfAdapt, typical
acceptance) trade agreement for speed: the scatter shows where each one lands."""

DEPLOY = """**Is the speedup worth deploying?** Each row is one strategy from a benchmark: what it measured
(speedup, tokens per target forward, how often its output is identical to autoregressive decoding,
the original model's negative log-likelihood of its text, math answers right) beside what it costs
to run: extra models to serve, extra parameters and memory (a draft, heads or an adapter, and the
draft's KV cache), training required, and forwards per token. The costs come from the models the
benchmark's traces name, loaded here. Speculation buys time when a forward is limited by reading
the weights; with many users in one batch the device becomes busy computing and extra verified
tokens stop being free. The curve predicts where each strategy stops paying on this device."""

SERVING = """**Measured, not predicted: the same strategies on vLLM.** A real serving engine (vLLM, started by
`python -m mtp_viz bench --backend vllm` in its own environment) runs autoregressive decoding, n-gram
drafting (our prompt lookup) and our shipped draft model on the same prompts, with 1 to 32 clients at
once. Solid lines: its measured speedup over its own autoregressive decoding at the same number of
clients. Dashed: what our load model predicts for it; with a profile measured as served (`profile
--backend vllm`: the sweep's prompts from C clients on each server, prefills mixed in, each drafter's
own prefill, the speculative path's cost when it drafts nothing) that is a request's decode steps
times the served step plus its round of prefills, on each side. Where they part, the prediction
misses something the engine does. A dotted line marks the load from which the recommendation is
plain serving, and the worked example under the caption says why it sits there. Strategies vLLM
has no counterpart for are not on it: lookahead (no Jacobi decoding), self-speculation (no early
exit), MTP heads (vLLM's Medusa heads are independent per position; ours are sequential), ConfAdapt
(unverified, lossy) and mask-token speculation (no mask-token drafting)."""
