"""A DP rank that only holds blocks for a KV connector's peer (a prefill instance's finished
request, until the peer has read them or their deadline passes) does not keep the wave running:
the wave ends at its next sync, as in vLLM (whose waves count unfinished requests only), and the
rank polls the held blocks alone, with no dummy forward or collective, until they are freed."""

import asyncio
import sys
import time
from pathlib import Path

from dp_helpers import dp_client, simulated_dp_config, wait_idle

from minicore.kv_transfer.config import KVTransferConfig
from minicore.sampling_params import SamplingParams

# The engine processes import the fake connector by name: spawn hands them this sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv_transfer"))

HOLD_S = 4.0


async def test_blocks_held_for_a_peer_do_not_keep_the_wave_running():
    config = simulated_dp_config(2, kv_transfer_config=KVTransferConfig(
        "FakeNixlConnector", "kv_producer", "P", {"abort_request_timeout": HOLD_S},
        kv_connector_module_path="fake_connector"))
    async with dp_client(config) as client:
        params = SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        outputs = [output async for output in client.generate(
            list(range(1, 40)), params, "r", data_parallel_rank=0)]
        output = outputs[-1]
        assert output.finished and output.kv_transfer_params["do_remote_prefill"]
        held_at = time.monotonic()
        # Well before the deadline, the wave ends while rank 0 still holds the blocks.
        await wait_idle(client, timeout=HOLD_S / 2)
        stats = await client.call_utility("get_stats", engine_index=0)
        assert stats["request_ids"] == ["r"] and stats["kv_cache_usage"] > 0
        # Then rank 0, stepping alone, frees them at their deadline.
        while time.monotonic() - held_at < 3 * HOLD_S:
            stats = await client.call_utility("get_stats", engine_index=0)
            if stats["request_ids"] == [] and stats["kv_cache_usage"] == 0:
                break
            await asyncio.sleep(0.1)
        assert (stats["request_ids"], stats["kv_cache_usage"]) == ([], 0)
        assert time.monotonic() - held_at >= HOLD_S * 0.9
        assert not client.engine_core.coordinator.engines_running
