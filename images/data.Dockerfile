# Data sets baked onto a built fleetbox image (`invoke build --datasets mnist,...`), at Paddle's cache path
# for the image's user, so unmodified code (paddle.vision.datasets.MNIST()) finds them with no network.
ARG IMAGE=fleetbox/paddle:cpu
FROM ${IMAGE}
COPY dataset/ /root/.cache/paddle/dataset/
