"""ParallelConfig validation: clear errors for layouts that cannot be built."""

import pytest

from dpo_megatron.parallel import ParallelConfig


def test_valid_layout():
    ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).validate(8)
    ParallelConfig(tensor_model_parallel_size=2, data_parallel_size=2).validate(4)


@pytest.mark.parametrize(
    "cfg, world, message",
    [
        (
            ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
            6,
            "not divisible",
        ),
        (ParallelConfig(sequence_parallel=True), 2, "sequence_parallel"),
        (ParallelConfig(virtual_pipeline_model_parallel_size=2), 1, "virtual"),
        (
            ParallelConfig(tensor_model_parallel_size=2, data_parallel_size=2),
            2,
            "data_parallel_size",
        ),
        (ParallelConfig(backend="mpi"), 1, "backend"),
    ],
)
def test_invalid_layouts_name_the_fields(cfg, world, message):
    with pytest.raises(ValueError, match=message):
        cfg.validate(world)
