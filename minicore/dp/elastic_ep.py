"""Elastic expert parallelism: the DP group grows or shrinks while it serves (vLLM's
--enable-elastic-ep and POST /scale_elastic_ep), on the Ray backend.

Mirrors the scale path of vLLM's DPLBAsyncMPClient and CoreEngineActorManager
(vllm/v1/engine/core_client.py and utils.py: prepare_elastic_ep, commit_elastic_ep,
scale_up_elastic_ep) and EngineCore.reinitialize_distributed (vllm/v1/engine/core.py), a UTILITY
call here as there. A scale to N, driven by AsyncLLM.scale_elastic_ep:
1. refused, with nothing changed, below 1 rank, above one rank per expert, or where the cluster
   has no room: a scale up places the new ranks' placement groups first (bounded);
2. a scale down drains the leaving ranks (the highest): they get no new request, and theirs
   finish (within drain_timeout, else TimeoutError and nothing changed);
3. every engine pauses, keeping its requests (new requests wait at the frontend until step 5);
4. each staying rank leaves its DP group and joins a new one of N ranks at a fresh rendezvous port,
   doing what a new rank's startup does there, in the same order (the group, the fingerprint, the
   expert-parallel group), then re-shards its experts from the checkpoint (ElasticEP, which
   EngineControl.reinitialize_distributed calls); a new rank starts as an actor on the same
   frontend sockets and joins that group; a leaving rank's actor is killed once the others have
   left the old group (vLLM has it stop itself: ReconfigureRankType.SHUTDOWN_CURRENT_RANK);
5. the frontend's picture follows (identities, balancer, watchdog), and every engine resumes: the
   requests kept go on, on the same ranks; a new rank joins the frontend's wave with its first
   START_DP_WAVE or request, as any rank does.
A scale that fails in step 4 leaves the group broken: the engines are dead and the frontend says
so. The frontend's side is minicore/dp/ray_elastic.py. Left out: EPLB (redundant experts,
placement by load), moving a leaving rank's requests instead of draining them, the mp backend.
"""

import asyncio
import logging
from typing import TYPE_CHECKING

from minicore.dp.fingerprint import check_dp_ranks_agree
from minicore.dp.group import DPGroup
from minicore.engine.core_proc import HANDSHAKE_TIMEOUT_S
from minicore.model.expert_parallel import reshard_experts
from minicore.model.loader import load_model, resolve_device

if TYPE_CHECKING:
    from minicore.dp.engine import DPEngineCoreProc

logger = logging.getLogger(__name__)


class ElasticEP:
    """An engine's side of a scale (the composition root binds it with --enable-elastic-ep)."""

    async def reinitialize(self, engine: "DPEngineCoreProc", new_size: int, port: int) -> None:
        """On a paused rank, on its event loop: leave the DP group and join one of new_size
        ranks at port as a new rank's startup does, then re-shard the experts over it."""
        old_group, engine.dp_group = engine.dp_group, None
        await asyncio.to_thread(old_group.destroy)  # its expert-parallel group too
        config = engine.config
        pc = config.parallel_config
        pc.data_parallel_size, pc.data_parallel_rpc_port = new_size, port
        group = await asyncio.to_thread(DPGroup, engine.dp_rank, new_size,
                                        pc.data_parallel_address, port, HANDSHAKE_TIMEOUT_S)
        engine.dp_group = group
        # components.prepare_dp_rank's steps, in its order: the peers' collectives must match.
        await asyncio.to_thread(check_dp_ranks_agree, config, group.all_gather_json)
        ep_group = await asyncio.to_thread(group.new_expert_parallel_group,
                                           resolve_device(config.model_config.device))
        await engine._run_forward(_reshard, engine.model_runner, config, ep_group)


def _reshard(runner, config, group) -> None:
    """The runner's experts for its rank of the new group, from the checkpoint loaded anew."""
    mc = config.model_config
    source, _ = load_model(mc.model, dtype=mc.dtype, device=mc.device)
    info = reshard_experts(runner.model, source, group)
    logger.info("DP rank %d of %d: experts %d-%d of %d (elastic EP)", info.ep_rank, info.ep_size,
                info.local_experts.start, info.local_experts.stop - 1, info.num_experts)
