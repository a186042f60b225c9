"""The configs (`get_config()` each; every field with its comment in default.py), imported as
`trime_jax.configs.NAME` and given to the commands as `--config=configs/NAME.py` (or the bare NAME)."""

if __name__ != "trime_jax.configs":  # `from configs import ...` from a checkout's root: the name before 0.2
  raise ImportError(f"the configs are the package trime_jax.configs (from trime_jax.configs import default), "
                    f"not {__name__}")
