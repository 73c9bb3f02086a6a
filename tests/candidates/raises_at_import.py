import torch
raise RuntimeError("no GPU driver found, giving up")
