"""Drafter, the base of every drafting method, and the registry that finds methods by name.

Mirrors what vLLM's proposers share (vllm/v1/spec_decode/: NgramProposer, EagleProposer, ...,
chosen in GPUModelRunner.__init__ by `if self.speculative_config.method == ...`): after a step,
each request now decoding may get up to num_speculative_tokens drafts, none while
disable_by_batch_size requests or more run. Here that selection is the base's, a method only
drafts for one request (propose_for), and a Drafter subclass with a `method` registers itself, as
scheduling policies do (minicore/scheduler/policies/): a new method is one file of this package
and its tests. A drafter gets the requests it may draft for and returns DraftTokenIds; EngineCore
hands them to the scheduler (vLLM's post_step). With async scheduling the runner calls
propose_for itself, right after it samples, with a DraftRequest of its own state
(minicore/model/async_spec_decode.py). A method that drafts with a model over the target's hidden
states (use_eagle: MTP, mtp.py) is proposed by the runner, right after it samples, and its
Drafter hands the scheduler what the runner proposed (vLLM's take_draft_token_ids). Left out:
draft models and EAGLE heads.
"""

import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from minicore.request import Request, RequestStatus
from minicore.scheduler.interfaces import DraftTokenIds

if TYPE_CHECKING:
    from minicore.config import EngineConfig
    from minicore.sampling_params import SamplingParams
    from minicore.scheduler.output import SchedulerOutput
    from minicore.spec_decode.config import SpeculativeConfig

NO_DRAFTS = DraftTokenIds([], [])


@dataclass(slots=True)
class DraftRequest:
    """What a method may read of a request (a Request has it all): the runner's view of one,
    when it proposes under async scheduling. all_token_ids is the same list at every call, holding
    what it held at the call before and more, until the request is preempted or finishes."""
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: "SamplingParams"


def decoding_requests(requests: Mapping[str, Request],
                      scheduler_output: "SchedulerOutput") -> list[Request]:
    """The step's requests a drafter proposes for: still running, with only the newest token
    left to compute (the scheduler drops the drafts of one still prefilling)."""
    return [request for req_id in scheduler_output.num_scheduled_tokens
            if (request := requests.get(req_id)) is not None
            and request.status == RequestStatus.RUNNING
            and request.num_tokens - request.num_computed_tokens == 1]


class NoDrafter:
    """Without --speculative-config: no drafts."""

    def propose(self, requests: Mapping[str, Request], num_running: int,
                scheduler_output: "SchedulerOutput") -> DraftTokenIds:
        return NO_DRAFTS


class Drafter(ABC):
    """A drafting method: `method` is its name in --speculative-config."""
    method: ClassVar[str]
    registry: ClassVar[dict[str, type["Drafter"]]] = {}
    # Whether the runner drafts with a model of the checkpoint over the target's hidden states,
    # which keeps a KV cache of its own (vLLM's SpeculativeConfig.use_eagle: EAGLE, MTP).
    use_eagle: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "method" in cls.__dict__:
            Drafter.registry[cls.method] = cls

    @classmethod
    def verify_config(cls, config: "SpeculativeConfig") -> None:
        """Fill in this method's defaults and check its fields: ValueError naming the field."""
        return None

    def __init__(self, config: "SpeculativeConfig", max_model_len: int):
        self.k = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.max_model_len = max_model_len

    def propose(self, requests: Mapping[str, Request], num_running: int,
                scheduler_output: "SchedulerOutput") -> DraftTokenIds:
        """The drafts of the step's requests that now decode (vLLM's propose_draft_token_ids)."""
        self.forget(scheduler_output.finished_req_ids)
        if self.disable_by_batch_size and num_running >= self.disable_by_batch_size:
            return NO_DRAFTS
        drafted = decoding_requests(requests, scheduler_output)
        return DraftTokenIds([r.request_id for r in drafted],
                             [self.propose_for(r) for r in drafted])

    @abstractmethod
    def propose_for(self, request: Request | DraftRequest) -> list[int]:
        """At most self.k draft tokens for the request, none at or past max_model_len - 1 (the
        verifying step writes 1 + len(draft) tokens)."""

    def forget(self, finished_req_ids: set[str]) -> None:
        """Drop what the method keeps for requests that have finished."""
        return None


def drafters() -> dict[str, type[Drafter]]:
    """Every method, by name: each module of this package imported (when a config is built, not
    with the package, which minicore.protocol imports for spec_decode.metrics)."""
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"minicore.spec_decode.{module.name}")
    return Drafter.registry


def make_drafter(config: "EngineConfig", model_runner=None) -> Drafter | NoDrafter:
    """The engine's drafter; a use_eagle method's takes the model runner that proposes."""
    if (spec := config.speculative_config) is None:
        return NoDrafter()
    cls = drafters()[spec.method]
    runner = (model_runner,) if cls.use_eagle else ()
    return cls(spec, config.scheduler_config.max_model_len, *runner)
