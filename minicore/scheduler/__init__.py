"""The scheduler and the paged KV block manager, in pure Python (no torch, zmq or transformers)."""

from minicore.scheduler.block_pool import BlockPool
from minicore.scheduler.kv_cache_manager import KVCacheBlocks, KVCacheManager
from minicore.scheduler.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from minicore.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from minicore.scheduler.scheduler import Scheduler

__all__ = ["BlockPool", "CachedRequestData", "FreeKVCacheBlockQueue",
           "KVCacheBlock", "KVCacheBlocks", "KVCacheManager", "NewRequestData", "Scheduler",
           "SchedulerOutput"]
