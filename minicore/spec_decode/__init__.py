"""Speculative decoding's drafter: what proposes each request's draft tokens after a step.

vLLM's runner proposes drafts after sampling (GPUModelRunner.propose_draft_token_ids) and
EngineCore.post_step hands them to Scheduler.update_draft_token_ids. ngram drafts need only the
request's own tokens, which the scheduler holds, so here the drafter is bound in EngineCore and
proposes from the scheduler's requests after each update; NoDrafter, without
--speculative-config, does nothing. The drafts are verified by the runner's rejection sampler
(minicore/model/rejection_sampler.py).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minicore.config import EngineConfig
    from minicore.scheduler import Scheduler
    from minicore.scheduler.output import SchedulerOutput


class NoDrafter:
    def propose(self, scheduler: "Scheduler", scheduler_output: "SchedulerOutput") -> None:
        pass


def make_drafter(config: "EngineConfig"):
    if config.speculative_config is None:
        return NoDrafter()
    from minicore.spec_decode.ngram_proposer import NgramProposer

    return NgramProposer(config.speculative_config, config.scheduler_config.max_model_len)
