"""Present because transformers imports ``torchvision.transforms.v2.functional``."""
