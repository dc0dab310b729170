"""Elastic EP's frontend side on Ray: the scale of the DP group, as minicore/dp/elastic_ep.py
tells it (steps 1 to 5), from ElasticRayDPLBAsyncMPClient; AsyncLLM.scale_elastic_ep drives it.

Mirrors prepare_elastic_ep / commit_elastic_ep of vLLM's DPLBAsyncMPClient
(vllm/v1/engine/core_client.py) and CoreEngineActorManager.scale_up_elastic_ep
(vllm/v1/engine/utils.py).
"""

import asyncio
import dataclasses
import logging
import time

import ray

from minicore.dp.ray_launch import CoreEngineActorManager, RayDPLBAsyncMPClient, _cause
from minicore.model.expert_parallel import check_expert_parallel
from minicore.ports import free_port

logger = logging.getLogger(__name__)

# How long a scale waits for new ranks to be built and the group to come together.
SCALE_TIMEOUT_S = 300.0


class ElasticActorManager(CoreEngineActorManager):
    def retire(self, ranks: range) -> list:
        """Forget the ranks' actors and placement groups (their end is no news now); returns
        the actors, to kill."""
        actors = self.actors[ranks.start:]
        for pg in self.placement_groups[ranks.start:]:
            ray.util.remove_placement_group(pg)
        del self.actors[ranks.start:], self.placement_groups[ranks.start:]
        del self.node_ids[ranks.start:]
        return actors


class ElasticRayDPLBAsyncMPClient(RayDPLBAsyncMPClient):
    """The Ray backend's client, whose DP group AsyncLLM.scale_elastic_ep resizes."""

    manager_class = ElasticActorManager

    async def prepare_scale(self, new_size: int) -> None:
        """ValueError, with nothing changed, for a size the model or the cluster cannot take;
        for a scale up, the new ranks placed and started: their start overlaps serving, as
        vLLM's prepare step, each waiting at the new group's rendezvous for commit_scale."""
        from transformers import AutoConfig

        if isinstance(new_size, bool) or not isinstance(new_size, int) or new_size < 1:
            raise ValueError("new_data_parallel_size must be a positive integer")
        hf_config = await asyncio.to_thread(AutoConfig.from_pretrained,
                                            self.config.model_config.model, local_files_only=True)
        check_expert_parallel(hf_config, new_size)
        self.scale_port = free_port()  # the new group's rendezvous
        if new_size > self.num_engines:
            added = range(self.num_engines, new_size)
            try:
                await asyncio.to_thread(self.manager.place_ranks, added,
                                        time.monotonic() + SCALE_TIMEOUT_S)
            except TimeoutError as e:
                raise ValueError(f"no room for {new_size} DP ranks: {e}") from None
            pc = dataclasses.replace(self.manager.config.parallel_config,
                                     data_parallel_size=new_size,
                                     data_parallel_rpc_port=self.scale_port)
            self.manager.config = dataclasses.replace(self.manager.config, parallel_config=pc)
            self.manager.start_actors(self.manager.addresses, added)
            try:
                await self._first_frames(added)
            except Exception as e:  # nothing else changed: the group stays as it was
                for actor in self.manager.retire(added):
                    ray.kill(actor)
                raise RuntimeError(f"the new DP ranks did not start: {_cause(e)}") from e

    async def _first_frames(self, ranks: range) -> None:
        """Each new rank's first input frame (the ROUTER then routes to it), sent as its engine
        goes to the group's rendezvous: from then on the pause waits for no process start. An
        actor that fails before it is raised at once."""
        failed = asyncio.ensure_future(self.manager.wait_for_init(
            time.monotonic() + SCALE_TIMEOUT_S, ranks))
        try:
            for _ in ranks:
                while not self.input_socket.poll(0):
                    if failed.done():
                        failed.result()  # raises what failed (a success needs the group first)
                    await asyncio.sleep(0.05)
                self.input_socket.recv_multipart()
        finally:
            failed.cancel()

    async def drain(self, new_size: int, timeout: float) -> None:
        """A scale down's leaving ranks take no new request; returns once theirs are done
        (TimeoutError after timeout, and they take requests again)."""
        self.coordinator.selectable = range(min(new_size, self.num_engines))
        deadline = time.monotonic() + timeout
        while any(engine >= new_size for engine in self.reqs_in_flight.values()):
            if time.monotonic() > deadline:
                self.coordinator.selectable = range(self.num_engines)
                raise TimeoutError(f"the requests of DP ranks {new_size}.."
                                   f"{self.num_engines - 1} did not finish in {timeout:g} s")
            await asyncio.sleep(0.05)

    async def commit_scale(self, new_size: int) -> None:
        """With every engine paused: the ranks re-form the group at new_size, then the frontend
        follows. A failure leaves the client dead (the group is broken)."""
        old_size = self.num_engines
        leaving = self.manager.retire(range(new_size, old_size))
        calls = [self.call_utility_async("reinitialize_distributed", new_size, self.scale_port,
                                         engine_index=rank)
                 for rank in range(min(new_size, old_size))]
        added = range(old_size, max(new_size, old_size))
        try:
            num_blocks, *_ = await asyncio.gather(
                self._watch_actors(added, time.monotonic() + SCALE_TIMEOUT_S), *calls)
        except Exception as e:
            self.set_dead(f"scaling the DP group to {new_size} failed: {_cause(e)}")
            raise RuntimeError(f"scaling the DP group to {new_size} failed: {_cause(e)}") from e
        finally:
            for actor in leaving:
                ray.kill(actor)
        self._resize(new_size, num_blocks)
        logger.info("elastic EP: the DP group went from %d to %d ranks", old_size, new_size)

    def _resize(self, new_size: int, added_blocks: dict[int, int]) -> None:
        self.num_engines = self.config.parallel_config.data_parallel_size = new_size
        self._identities = [rank.to_bytes(2, "little") for rank in range(new_size)]
        self.coordinator.resize(new_size)
        self.watchdog.resize(new_size)
        self.num_blocks = {rank: blocks for rank, blocks in self.num_blocks.items()
                           if rank < new_size} | added_blocks
