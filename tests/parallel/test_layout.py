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


def test_the_start_up_line_names_the_expert_split_of_a_mixture_of_experts_model():
    """The layout the start-up line prints names how a mixture-of-experts model's experts are
    split (EP and expert TP), which TP x PP x DP alone hides (EP 2 runs on the ranks of DP 2);
    CP appears only above 1, and a dense model's layout is unchanged."""
    moe = ParallelConfig(expert_model_parallel_size=2, data_parallel_size=2)
    assert moe.describe(2, experts=True) == "TP 1 x PP 1 x DP 2 (experts: EP 2 x expert TP 1)"
    tp2 = ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=2)
    assert (
        tp2.describe(1, experts=True) == "TP 2 x PP 1 x CP 2 x DP 1 (experts: EP 1 x expert TP 2)"
    )
    assert tp2.describe(1) == "TP 2 x PP 1 x CP 2 x DP 1"
    assert ParallelConfig(pipeline_model_parallel_size=2).describe(1) == "TP 1 x PP 2 x DP 1"
