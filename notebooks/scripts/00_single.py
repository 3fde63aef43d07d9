"""00_single.py: a plain training loop on one device: where you start."""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-epochs", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)
    features = torch.randn(1024, 20)
    dataset = TensorDataset(features, (features.sum(1) > 0).long())  # a toy task: is the sum positive?
    loader = DataLoader(dataset, batch_size=32, shuffle=True)

    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    for epoch in range(args.num_epochs):
        for inputs, labels in loader:
            loss = nn.functional.cross_entropy(model(inputs.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch} loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
