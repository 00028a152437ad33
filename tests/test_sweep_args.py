"""``tools.sweep``'s argument checks, which run before it looks for a GPU."""

import pytest

from tools import sweep


@pytest.mark.parametrize("argv, message", [
    (["--op", "mla", "--num-splits", "0,x"], "expected a comma list of integers"),
    (["--op", "gqa", "--num-splits", "2,-1"], "counts must be >= 0"),
    (["--op", "gdn_decode", "--num-splits", "2"], "gdn_decode has no split-KV"),
])
def test_bad_split_counts_are_refused(argv, message):
    with pytest.raises(SystemExit) as e:
        sweep.main(argv)
    assert message in str(e.value.code)


def test_planned_splits_pass_the_checks(monkeypatch):
    """The default (the plan's own count) and explicit counts reach the GPU check, not an argument error."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["--op", "gdn_decode"], ["--op", "mla", "--num-splits", "0,2,3"]):
        with pytest.raises(SystemExit) as e:
            sweep.main(argv)
        assert e.value.code == "tools.sweep needs a CUDA GPU"
