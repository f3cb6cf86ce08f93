"""A small ResNet-style CNN with the in-place idioms of torchvision: ReLU(inplace=True) after
BatchNorm, `out += x` in the block. Module backward hooks cannot be used on it."""
import torch, precisiondiff
from torch import nn
class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False); self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False); self.bn2 = nn.BatchNorm2d(c)
    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)
def build():
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), BasicBlock(8), BasicBlock(8),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    x = torch.randn(2, 3, 16, 16); y = torch.randint(0, 10, (2,))
    return precisiondiff.Workload(m, x, loss=lambda o: nn.functional.cross_entropy(o.float() if o.dtype != torch.float64 else o, y.to(o.device)))
