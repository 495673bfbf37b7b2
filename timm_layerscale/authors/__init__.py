"""Models of the authors' computation in their own key layout, for the families whose authors' files no installed
library reads (ViT-5): plain PyTorch, no timm, no registry; a family's loader imports its module where it runs."""
