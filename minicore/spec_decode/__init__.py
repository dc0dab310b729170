"""Speculative decoding: drafting methods that propose each request's draft tokens after a step
(drafter.py: the Drafter base, its registry and make_drafter; one file per method, e.g.
ngram_proposer.py), their config (config.py) and acceptance counters (metrics.py).

vLLM's runner proposes drafts after sampling (GPUModelRunner.propose_draft_token_ids) and
EngineCore.post_step hands them to Scheduler.update_draft_token_ids. A method that needs only the
request's own tokens (ngram) proposes from the scheduler's requests after each update, in
EngineCore; one that runs the checkpoint's MTP layer (mtp.py) is proposed by the runner
(minicore/model/eagle.py) and handed over there. The drafts are verified by the runner's
rejection sampler (minicore/model/rejection_sampler.py).
"""
