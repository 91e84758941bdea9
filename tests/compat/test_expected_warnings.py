"""compat.expected_warnings: the warnings every run prints are silenced, others still show."""

import warnings

from dpo_megatron.compat.expected_warnings import filter_expected_warnings


def test_expected_warnings_are_silenced_and_others_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_expected_warnings()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back", UserWarning)
        warnings.warn("something the user must see", UserWarning)
        warnings.warn(
            "When using sequence parallelism it is recommended to set the environment "
            "variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
            UserWarning,
        )
    assert [str(w.message) for w in caught][0] == "something the user must see"
    assert len(caught) == 2  # the CUDA advice is actionable on a GPU: kept unless on the CPU
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_expected_warnings(cpu=True)
        warnings.warn(
            "When using sequence parallelism it is recommended to set the environment "
            "variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
            UserWarning,
        )
    assert caught == []


def test_the_checkpoint_load_future_warnings_are_torchs_own_and_silenced():
    """torch 2.13's messages, as megatron-core's loader triggers them on every checkpoint load
    (8 lines at 4 ranks before)."""
    import inspect

    import torch.distributed._shard._utils as shard_utils
    import torch.distributed.checkpoint.state_dict_loader as loader

    messages = [
        "`load_state_dict` is deprecated and will be removed in future versions. "
        "Please use `load` instead.",
        shard_utils.DEPRECATE_MSG,
    ]
    assert messages[0].split(". ")[0] in inspect.getsource(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_expected_warnings()
        for message in messages:
            warnings.warn(message, FutureWarning)
        warnings.warn("a FutureWarning the user must see", FutureWarning)
    assert [str(w.message) for w in caught] == ["a FutureWarning the user must see"]


def test_the_converter_filters_before_megatron_core_is_imported():
    """scripts/convert_megatron_to_hf.py printed 6 Apex / transformer-engine warnings."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}  # Python's default filters, as a user runs it
    for script in ("convert_megatron_to_hf.py", "convert_hf_to_megatron.py"):
        code = (
            f"import runpy; runpy.run_path({os.path.join(root, 'scripts', script)!r}, "
            f"run_name='as_a_module'); "  # its top level (filters, imports), not main()
            f"import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert "Warning" not in out.stderr, out.stderr[-2000:]
