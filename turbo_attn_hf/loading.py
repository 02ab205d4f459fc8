"""The keywords every entry point of ours (chat, calibrate, the eval harness) passes to ``from_pretrained``.

transformers >= 5.25 kernelizes a loaded model with Hub kernels by default (``use_kernels`` None -> True). That
needs the ``kernels`` package (0.19, which a package index may lack) and the Hugging Face Hub, and swaps stock
layers for downloaded ones. Our entry points load local files offline, and the benchmarks compare attention backends
on the same stock layers, so they pass ``use_kernels=False`` (accepted since 5.17, where it is the default already).
A user's own ``from_pretrained`` is left as transformers has it.
"""

#: ``AutoModelForCausalLM.from_pretrained(path, ..., **LOAD_KWARGS)``
LOAD_KWARGS = {"use_kernels": False}
