"""The training runtime shared by the language-model trainer (`trime_jax/train.py`) and the translation trainer
(`trime_jax/mt/train.py`): one writer per directory (`lock`), workdir files (`workdir`: metrics lines, the stored
config, the checkpoint steps on disk, which process writes), preemption, progress, the optimizer and schedule
(`optim`) and the checks of the `train` section both trainers' validators apply (`config`)."""
