import logging as _logging

# transformers imports torchao whenever it is installed (its quantizer registry), also in runs
# that never use it; torchao then warns for each CUDA extension a CPU build of torch cannot load,
# and torch warns about torchao's enum registrations. Those lines say nothing about the run and
# would stand before a refusal that is meant to be one line. FP8 training imports torchao itself
# (trainer/gpu/fp8_train.py) and reports what fails there.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
