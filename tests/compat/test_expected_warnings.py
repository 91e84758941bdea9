"""compat.expected_warnings: the warnings every run prints are silenced, others still show."""

import warnings

from dpo_megatron.compat.expected_warnings import filter_expected_warnings


def test_expected_warnings_are_silenced_and_others_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_expected_warnings()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back", UserWarning)
        warnings.warn("something the user must see", UserWarning)
        warnings.warn("When using sequence parallelism it is recommended to set the environment "
                      "variable CUDA_DEVICE_MAX_CONNECTIONS to 1", UserWarning)
    assert [str(w.message) for w in caught][0] == "something the user must see"
    assert len(caught) == 2  # the CUDA advice is actionable on a GPU: kept unless on the CPU
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_expected_warnings(cpu=True)
        warnings.warn("When using sequence parallelism it is recommended to set the environment "
                      "variable CUDA_DEVICE_MAX_CONNECTIONS to 1", UserWarning)
    assert caught == []
