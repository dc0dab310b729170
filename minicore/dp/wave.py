"""The DP busy loop's rules that need no collective: which steps sync, and when a rank runs a
dummy batch.

They are DPEngineCoreProc's (vllm/v1/engine/core.py; minicore/dp/engine.py), kept here in pure
Python so that the policy simulator (minicore/dp/simulator.py), which steps the real schedulers
without torch, follows the very same rules instead of restating them. The collectives themselves
are minicore/dp/group.py's; the balance gate's threshold is BalanceScheduler's.
"""

# vLLM's: the unfinished-requests all-reduce runs every this many steps of a wave.
STEPS_PER_SYNC = 32


def is_sync_step(step_counter: int) -> bool:
    """Whether the step_counter-th step of a wave (counting from 1) all-reduces "any unfinished
    request?": only then can the wave end, when no rank has one (vLLM pays for the all-reduce
    every STEPS_PER_SYNC steps only)."""
    return step_counter % STEPS_PER_SYNC == 0


def runs_dummy_batch(executed: bool, has_unfinished: bool, engines_running: bool) -> bool:
    """Whether a rank runs a dummy batch after its step: when the step ran no forward while the
    wave runs or the rank holds requests (held back by the balance gate, blocked on KV blocks),
    so that it issues the same collectives as its peers. A rank with nothing in an idle wave runs
    nothing."""
    return not executed and (has_unfinished or engines_running)
