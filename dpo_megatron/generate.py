"""``python -m dpo_megatron.generate``: the ``generate`` command,
:mod:`dpo_megatron.cli.generate`."""

if __name__ == "__main__":  # the command by its module name: nothing of it is imported here
    import runpy

    runpy.run_module("dpo_megatron.cli.generate", run_name="__main__", alter_sys=True)
