"""The weight transfer group (minicore/dp/weight_transfer.py) between a trainer and two engine
ranks in one process: the engines join on threads of their own, the trainer's broadcast arrives
whole at each, in every dtype, on the engine's device, in the order update_info names; on CPU the
group is gloo's, on both ends; a bad init_info or update_info is refused naming the field."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from minicore.dp.weight_transfer import join_as_engine, trainer_init
from minicore.ports import free_port


def test_a_trainer_broadcasts_to_every_engine_rank():
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                 "rank_offset": 1, "world_size": 3}
    engines = [join_as_engine(init_info, dp_rank, torch.device("cpu")) for dp_rank in (0, 1)]
    trainer = trainer_init(init_info, device="cpu")  # a GPU trainer of CPU engines: say so
    ends = [engine.result(timeout=60) for engine in engines]
    assert [end.rank for end in ends] == [1, 2]
    tensors = [("a.weight", torch.randn(4, 3)), ("b.bias", torch.randn(5).to(torch.bfloat16))]
    update_info = trainer.update_info(tensors)
    assert update_info == {"names": ["a.weight", "b.bias"], "dtype_names": ["float32", "bfloat16"],
                           "shapes": [[4, 3], [5]]}
    with ThreadPoolExecutor(2) as pool:
        received = [pool.submit(end.receive, update_info) for end in ends]
        trainer.send(tensors)
        for future in received:
            got = future.result(timeout=60)
            assert [name for name, _ in got] == ["a.weight", "b.bias"]
            for (_, sent), (_, tensor) in zip(tensors, got):
                assert tensor.device.type == "cpu" and torch.equal(tensor, sent.to(tensor.device))
    with pytest.raises(ValueError, match="'float99' is not a torch dtype"):
        ends[0].receive({"names": ["a"], "dtype_names": ["float99"], "shapes": [[1]]})


@pytest.mark.parametrize("init_info, message", [
    ({"master_port": 5, "world_size": 2}, "master_address must be a host"),
    ({"master_address": "h", "master_port": 0, "world_size": 2}, "master_port must be"),
    ({"master_address": "h", "master_port": 5, "world_size": True}, "world_size must be"),
    ([1, 2], "init_info must be an object"),
])
def test_a_bad_init_info_is_refused_before_joining(init_info, message):
    with pytest.raises(ValueError, match=message):
        join_as_engine(init_info, 0, torch.device("cpu"))
