"""msModelSlim's AscendV1 checkpoints: the quantisation method that loads them, and the file that
describes each tensor's scheme. Torch-free: ``ascend-patch doctor`` reads it without torch."""

NAME = "ascend"
DESCRIPTION_FILE = "quant_model_description.json"
