"""fleetbox for scripts in Paddle's high-level style (paddle.Model, prepare, fit): one callback gives them what a
hand-written loop gets from fleetbox_metrics, fleetbox_checkpoint and fleetbox_progress.

    import fleetbox_fit                          # on PYTHONPATH in every fleetbox job container
    model.fit(train_data, epochs=5, batch_size=64, callbacks=[fleetbox_fit.Callback()])

Every rank, every batch: a metrics line (loss, samples, the batch's seconds and the rank's own part of them:
waiting for its data and its forward pass, which no peer takes part in; a straggler shows there), and progress
for hang detection; an evaluation inside fit is a declared phase. Checkpoints of the network and the optimizer
go through fleetbox_checkpoint: at every epoch's end (`every_epochs`), and wherever fleetbox asks for one (a
queue's time limit, SIGTERM; FLEETBOX_CHECKPOINT_EVERY=N adds one every N batches).

Resuming. fit cannot start in the middle of an epoch. A restarted job restores the network and optimizer from
the newest checkpoint every rank has; the epochs finished before it are not trained again (fit is stopped once
the remaining ones are done, so its own progress bar counts them from 1), and the epoch that was in progress
starts again from its first batch, with the weights of that checkpoint: from an epoch's end, with the weights
the run had there; from a checkpoint inside an epoch (a time limit), that epoch's batches before it are trained a
second time. The steps in the metrics lines count every batch trained, across restarts. Not carried over: the
data order (fit's DistributedBatchSampler counts its shuffles from 0 again, so resumed epochs see the orders of
the first ones), a learning-rate scheduler that steps by epoch unless it is part of the optimizer's state, and
an EarlyStopping's stop (a restart after it trains the epochs it skipped).

A rank's own time is what it spends on the host side of its batch: its data, and launching its forward pass.
On a GPU, kernels run after their launch, so a rank slow in computing shows in its peers' wait, not in its own
time; a straggler in its data (the commonest: a slow file system, a slow transform) shows.
"""
import time

import fleetbox_checkpoint
import fleetbox_metrics
import fleetbox_progress
import paddle

NEVER = 10**15   # no checkpoint by batch count unless FLEETBOX_CHECKPOINT_EVERY asks for one


class Callback(paddle.callbacks.Callback):
    def __init__(self, every_epochs: int = 1, keep: int = 3):
        super().__init__()
        if not isinstance(every_epochs, int) or every_epochs < 1:
            raise ValueError(f"fleetbox_fit: every_epochs must be a whole number >= 1 (got {every_epochs!r})")
        self.every_epochs, self.keep = every_epochs, keep
        self.ckpt = self.meter = self._phase = self._skip = None
        self.trained = 0      # batches trained, across restarts (the checkpoint's step)
        self.epochs_done = 0  # epochs finished, across restarts
        self.in_epoch = 0     # batches of the epoch in progress
        self._own = 0.0
        self._mark = time.perf_counter()
        self._hooks = []
        self._stopped = False   # this callback ended fit early (a resumed fit): fit's flag is reset after

    # -- the parts fit does not give a callback --

    def _network(self):
        return self.model.network

    def _optimizer(self):
        return self.model._optimizer

    def _state(self):
        """What a checkpoint records of fit's place: a save at an epoch's last batch (a stop asked there, or
        FLEETBOX_CHECKPOINT_EVERY) has that epoch done, as the epoch's-end save would say."""
        per_epoch = self.params.get("steps")
        if per_epoch and self.in_epoch >= per_epoch:
            return {"epochs": self.epochs_done + 1, "in_epoch": 0}
        return {"epochs": self.epochs_done, "in_epoch": self.in_epoch}

    # -- fit's events --

    def on_train_begin(self, logs=None):
        epochs, per_epoch = self.params.get("epochs"), self.params.get("steps")
        net = self._network()
        # restored first (it agrees with every rank through collectives), then the last step is known
        self.ckpt = fleetbox_checkpoint.Checkpoint(every=NEVER, keep=self.keep)
        self.trained = self.ckpt.restore(net, self._optimizer())
        # fit's place, as the first rank that has one restored it: every rank must run as many epochs (a rank the
        # checkpoint has no file of, the job grown by a node, starts its own state fresh, not its epochs)
        saved = next((x for x in self.ckpt._gather(self.ckpt.rank_state) if x), None) or {}
        self.epochs_done, again = int(saved.get("epochs", 0)), int(saved.get("in_epoch", 0))
        left = max(0, (epochs or 0) - self.epochs_done)
        self.ckpt.total = self.trained + left * per_epoch if epochs and per_epoch else None
        if self.trained and self.ckpt.rank == 0:
            print(f"fleetbox_fit: resumed at step {self.trained} ({self.epochs_done} of {epochs} epoch(s) done): "
                  + (f"fit runs the {left} left" if left else "nothing left to train (fit reads one batch and returns)")
                  + (f"; epoch {self.epochs_done + 1} from its start, its first {again} batch(es) a second time"
                     if again and left else ""), flush=True)
        if epochs and left == 0:   # all done before this restart: fit reads one batch, trains nothing, returns
            self._skip = self.model.train_batch
            self.model.train_batch = self._untrained
            self.model.num_iters = 1
        # the rank's own part of a batch: its forward pass (no peer takes part), added to its wait for data
        self._hooks = [net.register_forward_pre_hook(self._forward_starts),
                       net.register_forward_post_hook(self._forward_ends)]
        self.meter = fleetbox_metrics.Meter()
        self._mark = time.perf_counter()

    def _untrained(self, inputs, labels=None, update=True):
        loss = [paddle.zeros([]).numpy()]
        return (loss, []) if self.model._metrics and self.model._loss else loss

    def _forward_starts(self, layer, inputs):
        self._forward_at = time.perf_counter()

    def _forward_ends(self, layer, inputs, outputs):
        self._own += time.perf_counter() - self._forward_at

    def on_train_batch_begin(self, step, logs=None):
        self._own = time.perf_counter() - self._mark   # since the last batch ended: its data

    def on_train_batch_end(self, step, logs=None):
        if self._skip is not None:
            return
        logs = logs or {}
        loss = logs.get("loss")
        loss = loss[0] if isinstance(loss, (list, tuple)) and loss else loss
        ranks = max(1, paddle.distributed.get_world_size())
        samples = int(logs.get("batch_size", 0)) // ranks or None   # fit counts every rank's batch
        self.meter.step(self.trained, loss=None if loss is None else float(loss), samples=samples,
                        own_seconds=self._own, epoch=self.epochs_done)
        self.trained += 1
        self.in_epoch = step + 1
        self.ckpt.step(self.trained, self._network(), self._optimizer(), rank_state=self._state)
        self._mark = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if self._skip is not None:
            return
        self.epochs_done += 1
        self.in_epoch = 0
        epochs = self.params.get("epochs")
        if self.epochs_done % self.every_epochs == 0 or self.epochs_done == epochs:
            self.ckpt.save(self.trained, self._network(), self._optimizer(), rank_state=self._state())
        if epochs and self.epochs_done >= epochs and epoch < epochs - 1:   # a resumed fit: the ones left are done
            self.model.stop_training = self._stopped = True
        self._mark = time.perf_counter()   # the save is not the next batch's own work

    def on_eval_begin(self, logs=None):
        self._phase = fleetbox_progress.phase("evaluation")
        self._phase.__enter__()

    def on_eval_end(self, logs=None):
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None
        self._mark = time.perf_counter()   # the evaluation is not the next batch's wait for data

    def on_train_end(self, logs=None):
        for h in self._hooks:
            h.remove()
        if self._skip is not None:
            self.model.train_batch, self._skip = self._skip, None
        if self._stopped:   # Paddle resets it only in Model(): a second fit in the script would stop at once
            self.model.stop_training = self._stopped = False
        self.ckpt.done()
