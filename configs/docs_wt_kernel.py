"""docs-wt domain adaptation: the held-out Linux kernel documentation (linux-doc-6.1), evaluated with a model
trained on configs/docs_wt*.py without retraining (the paper's BooksCorpus table). Its splits are the kernel
documents only, encoded with the checkpoint's vocabulary (kernel words unseen in training are <unk>); its
train split is the datastore of the new domain (trime_jax.launch.build_datastore --config=configs/docs_wt_kernel.py)."""

from trime_jax.configs import docs_wt_ext


def get_config():
  c = docs_wt_ext.get_config()
  c.data.exclude_packages = ()  # nothing excluded ...
  c.data.only_packages = ("linux-doc-6.1",)  # ... only the kernel documentation
  c.data.cache_dir = "runs/cache/docs_wt_kernel"  # its own cache (encoded with the export's vocabulary)
  return c
