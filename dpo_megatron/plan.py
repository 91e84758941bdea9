"""``python -m dpo_megatron.plan``: the ``plan`` command, :mod:`dpo_megatron.cli.plan`."""

if __name__ == "__main__":  # the command by its module name: nothing of it is imported here
    import runpy

    runpy.run_module("dpo_megatron.cli.plan", run_name="__main__", alter_sys=True)
