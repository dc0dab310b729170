"""Drafting methods are plug-ins (minicore/spec_decode/drafter.py): a Drafter subclass in a file
of minicore/spec_decode/ registers itself under its `method`, so a new method is that file and
its tests. Shown with a method written here, in a file of the package for the test's duration:
the config takes it by name (its own verify_config filling its defaults), the CLI's help lists it,
make_drafter builds it, and it gets the shared selection (only requests now decoding; none at
disable_by_batch_size) without touching the scheduler."""

import subprocess
import sys
import textwrap

import pytest

import minicore.spec_decode
from minicore.config import EngineConfig
from minicore.scheduler.interfaces import DraftTokenIds
from minicore.spec_decode.config import SpeculativeConfig
from minicore.spec_decode.drafter import Drafter, NoDrafter, drafters, make_drafter
from minicore.spec_decode.mtp import MTPDrafter
from minicore.spec_decode.ngram_proposer import NgramProposer
from minicore.testing import make_request, make_scheduler, step

REPEAT_LAST = textwrap.dedent('''
    """RepeatLast: drafts the request's last token k times (a test's method)."""
    from minicore.spec_decode.drafter import Drafter


    class RepeatLast(Drafter):
        method = "repeat_last"

        @classmethod
        def verify_config(cls, config):
            if config.prompt_lookup_max is None:
                config.prompt_lookup_max = 1

        def propose_for(self, request):
            return [request.all_token_ids[-1]] * self.k
''')


def test_every_method_file_registers_itself():
    assert drafters() == {"mtp": MTPDrafter, "ngram": NgramProposer}


def test_a_new_method_is_one_file(plugin_file):
    plugin_file(minicore.spec_decode, "repeat_last_for_test", REPEAT_LAST, Drafter.registry,
                "repeat_last")
    assert set(drafters()) == {"mtp", "ngram", "repeat_last"}
    spec = SpeculativeConfig(method="repeat_last", num_speculative_tokens=2,
                             disable_by_batch_size=3)
    assert spec.prompt_lookup_max == 1  # its own defaults
    drafter = make_drafter(EngineConfig(speculative_config=spec))
    assert type(drafter).__name__ == "RepeatLast"
    s = make_scheduler(speculative_config=spec, max_num_batched_tokens=12,
                       enable_chunked_prefill=True)
    s.add_request(make_request("a", [5, 6, 7]))
    s.add_request(make_request("b", list(range(20, 40))))  # still prefilling after a step
    out = step(s, {"a": 9}).out
    drafts = drafter.propose(s.requests, len(s.running), out)
    assert (drafts.req_ids, drafts.draft_token_ids) == (["a"], [[9, 9]])
    s.add_request(make_request("c", [1, 2]))
    out = step(s).out
    assert drafter.propose(s.requests, 3, out).req_ids == []  # disable_by_batch_size
    help_text = subprocess.run([sys.executable, "-m", "minicore", "serve", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    assert "Methods: mtp, ngram, repeat_last" in " ".join(help_text.split())


def test_an_unknown_method_is_refused_naming_the_methods():
    with pytest.raises(ValueError, match="method 'eagle' is not supported by minicore: "
                                         "methods 'mtp', 'ngram'"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2)


def test_without_a_config_no_drafts():
    drafter = make_drafter(EngineConfig())
    assert isinstance(drafter, NoDrafter)
    s = make_scheduler()
    s.add_request(make_request("a", [1, 2, 1]))
    drafts = drafter.propose(s.requests, 1, step(s).out)
    assert drafts.req_ids == []
    s.update_draft_token_ids(drafts)  # what EngineCore hands over every step: nothing to take
    with pytest.raises(ValueError, match="need a scheduler built with a speculative_config"):
        s.update_draft_token_ids(DraftTokenIds(["a"], [[1]]))
