"""The drafter's own layers: its attention masks, the fused elementwise pieces, DFlash2's block
convolution, and the modeling file every export carries (hf_dflash.py, one formula for the
trainer and for transformers). trainer/model.py builds the drafter from them; nothing here
imports the rest of the trainer."""
