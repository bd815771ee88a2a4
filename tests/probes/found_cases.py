# Training in each of Paddle's styles, with no line of fleetbox: `python found_cases.py CASE` prints, as its last
# line, the JSON of what the training itself saw (each step's loss and learning rate, as the script reads them),
# for the test to hold the metrics fleetbox found (fleetbox_found) to.
import json
import sys

import numpy as np
import paddle

case = sys.argv[1]
paddle.seed(7)
x = np.random.default_rng(7).standard_normal((64, 8)).astype("float32")
y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
seen = []

if case == "static":   # a static program: the loss fetched by Executor.run; its test clone run too (not a step)
    paddle.enable_static()
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        xs = paddle.static.data("x", [None, 8], "float32")
        ys = paddle.static.data("y", [None, 1], "float32")
        loss = paddle.nn.functional.mse_loss(paddle.static.nn.fc(xs, 1), ys)
        test = main.clone()
        sched = paddle.optimizer.lr.StepDecay(learning_rate=0.1, step_size=2, gamma=0.5)
        opt = paddle.optimizer.SGD(learning_rate=sched)
        opt.minimize(loss)
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(startup)
    for i in range(6):
        lr = opt.get_lr()
        (value,) = exe.run(main, feed={"x": x[i * 8:(i + 1) * 8], "y": y[i * 8:(i + 1) * 8]}, fetch_list=[loss])
        exe.run(test, feed={"x": x[:8], "y": y[:8]}, fetch_list=[loss])
        sched.step()
        seen.append({"loss": float(value), "lr": lr})
elif case == "fit":   # paddle.Model's fit: the loss its own logs give each batch
    class Logs(paddle.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            seen.append({"loss": float(logs["loss"][0]), "lr": self.model._optimizer.get_lr()})

    net = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 1))
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.Adam(learning_rate=0.01, parameters=net.parameters()), paddle.nn.MSELoss())
    model.fit(paddle.io.TensorDataset([paddle.to_tensor(x), paddle.to_tensor(y)]), epochs=1, batch_size=16,
              verbose=0, callbacks=[Logs()])
else:   # a hand-written loop: "odd" steps (backward twice, on a vector) get no loss; "meter" logs its own
    if case == "meter":
        import fleetbox_metrics
    net = paddle.nn.Linear(8, 1)
    opt = paddle.optimizer.Momentum(learning_rate=0.05, parameters=net.parameters())
    loader = paddle.io.DataLoader(paddle.io.TensorDataset([paddle.to_tensor(x), paddle.to_tensor(y)]), batch_size=8)
    for i, (xb, yb) in enumerate(loader):
        err = net(xb) - yb
        loss = (err * err).mean()
        kind = "plain"
        if case == "odd" and i in (1, 2):
            kind = "twice"
            (loss / 2).backward(retain_graph=True)
            (loss / 2).backward()
        elif case == "odd" and i == 4:
            kind = "vector"
            (err * err).backward()
        else:
            loss.backward()
        opt.step()
        opt.clear_grad()
        seen.append({"loss": float(loss), "lr": opt.get_lr(), "kind": kind, "batch": int(xb.shape[0])})
        if case == "meter":
            fleetbox_metrics.log(i, loss=float(loss))
print(json.dumps(seen), flush=True)
