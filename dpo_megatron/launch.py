"""``python -m dpo_megatron.launch``: the launcher, :mod:`dpo_megatron.cli.launch`."""

if __name__ == "__main__":  # the command by its module name: nothing of it is imported here
    import runpy

    runpy.run_module("dpo_megatron.cli.launch", run_name="__main__", alter_sys=True)
