"""Runs in the cpu image (it has numpy, cv2, scipy): writes a tiny Flowers set in Paddle's real formats."""
import io
import os
import sys
import tarfile

import cv2
import numpy as np
import scipy.io

out = os.path.join(sys.argv[1], "flowers")
os.makedirs(out, exist_ok=True)
n = 12
with tarfile.open(os.path.join(out, "102flowers.tgz"), "w:gz") as tar:
    for i in range(1, n + 1):
        ok, buf = cv2.imencode(".jpg", np.full((32, 40, 3), i * 10, np.uint8))
        data = buf.tobytes()
        info = tarfile.TarInfo(f"jpg/image_{i:05}.jpg")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
# Paddle trains on "tstid" (images 1-6): every one of them is class 102, the label a missing 1 -> 0 shift
# breaks (cross-entropy over 102 classes takes 0..101); the other splits hold class 1.
labels = [102] * 6 + [1] * (n - 6)
scipy.io.savemat(os.path.join(out, "imagelabels.mat"), {"labels": np.array([labels])})
scipy.io.savemat(os.path.join(out, "setid.mat"), {"tstid": np.array([[1, 2, 3, 4, 5, 6]]),
                                                  "trnid": np.array([[7, 8, 9]]), "valid": np.array([[10, 11, 12]])})
