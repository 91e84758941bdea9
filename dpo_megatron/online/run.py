"""``python -m dpo_megatron.online.run``: the ``online`` command, :mod:`dpo_megatron.cli.online`
(which sits above this package)."""

if __name__ == "__main__":  # the command by its module name: nothing of it is imported here
    import runpy

    runpy.run_module("dpo_megatron.cli.online", run_name="__main__", alter_sys=True)
