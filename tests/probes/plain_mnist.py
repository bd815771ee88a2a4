# A small CNN on MNIST, data parallel, written as Paddle's own docs write it (the LeNet tutorial's training loop,
# paddle.DataParallel and a DistributedBatchSampler), with a learning-rate schedule: no line of fleetbox. Its loss
# and learning rate reach the job's metrics from the training itself (fleetbox_found). Its arguments: the training
# images' and labels' files (given, Paddle reads them without its MD5 check: the tests' MNIST is synthetic).
import sys

import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.io import DataLoader, DistributedBatchSampler
from paddle.vision.datasets import MNIST
from paddle.vision.transforms import Normalize


class LeNet(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.conv1 = paddle.nn.Conv2D(in_channels=1, out_channels=6, kernel_size=5, stride=1, padding=2)
        self.max_pool1 = paddle.nn.MaxPool2D(kernel_size=2, stride=2)
        self.conv2 = paddle.nn.Conv2D(in_channels=6, out_channels=16, kernel_size=5, stride=1)
        self.max_pool2 = paddle.nn.MaxPool2D(kernel_size=2, stride=2)
        self.linear1 = paddle.nn.Linear(in_features=16 * 5 * 5, out_features=120)
        self.linear2 = paddle.nn.Linear(in_features=120, out_features=84)
        self.linear3 = paddle.nn.Linear(in_features=84, out_features=10)

    def forward(self, x):
        x = self.max_pool1(F.relu(self.conv1(x)))
        x = self.max_pool2(F.relu(self.conv2(x)))
        x = paddle.flatten(x, start_axis=1, stop_axis=-1)
        x = F.relu(self.linear1(x))
        x = F.relu(self.linear2(x))
        return self.linear3(x)


def train():
    dist.init_parallel_env()
    paddle.seed(2024)
    transform = Normalize(mean=[127.5], std=[127.5], data_format="CHW")
    train_dataset = MNIST(image_path=sys.argv[1], label_path=sys.argv[2], mode="train", transform=transform,
                          backend="cv2")
    sampler = DistributedBatchSampler(train_dataset, batch_size=50, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_sampler=sampler)

    model = paddle.DataParallel(LeNet())
    model.train()
    scheduler = paddle.optimizer.lr.ExponentialDecay(learning_rate=0.002, gamma=0.97)
    optim = paddle.optimizer.Adam(learning_rate=scheduler, parameters=model.parameters())
    epochs = 5
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch_id, data in enumerate(train_loader()):
            x_data = data[0]
            y_data = data[1]
            predicts = model(x_data)
            loss = F.cross_entropy(predicts, y_data)
            acc = paddle.metric.accuracy(predicts, y_data)
            loss.backward()
            if batch_id % 3 == 0:
                print(f"epoch: {epoch}, batch_id: {batch_id}, loss is: {loss.numpy()}, acc is: {acc.numpy()}")
            optim.step()
            optim.clear_grad()
            scheduler.step()


if __name__ == "__main__":
    train()
