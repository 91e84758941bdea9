"""The house utilities (dpo_megatron/utils): atomic writes, content keys, the rank-0 test."""

import hashlib
import os

import pytest

from dpo_megatron.utils import ranks
from dpo_megatron.utils.cache import CACHE_VERSION, content_key
from dpo_megatron.utils.files import _umask, atomic_file, write_json_atomic, write_text_atomic
from dpo_megatron.utils.modules import unwrap


def test_atomic_file_replaces_on_success_and_keeps_the_old_file_on_error(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    write_text_atomic(path, "one")
    assert path.read_text() == "one"
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()  # not mkstemp's private 0o600
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file(path) as tmp:
            with open(tmp, "w") as f:
                f.write("two")
            raise RuntimeError("boom")
    assert path.read_text() == "one"
    assert os.listdir(path.parent) == ["f.txt"]  # no temporary left behind
    write_json_atomic(path, {"b": 1})
    assert path.read_text() == '{\n "b": 1\n}'


def test_content_key_is_sha256_of_sorted_json_with_the_cache_version():
    expected = hashlib.sha256(
        f'{{"a": 1, "b": "x", "version": {CACHE_VERSION}}}'.encode()
    ).hexdigest()
    assert content_key({"b": "x", "a": 1}) == expected
    assert content_key({"a": 2, "b": "x"}) != expected


def test_rank_without_a_process_group_is_torchruns_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert ranks.rank() == 0 and ranks.is_rank0()
    monkeypatch.setenv("RANK", "3")
    assert ranks.rank() == 3 and not ranks.is_rank0()


def test_unwrap_peels_every_wrapper():
    class Wrapper:
        def __init__(self, module):
            self.module = module

    inner = object()
    assert unwrap(Wrapper(Wrapper(inner))) is inner and unwrap(inner) is inner
