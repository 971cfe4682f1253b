"""GPU check (one GPU): CUDA parameters and optimizer state through tp-run's state
transfer. 2 ranks + 1 spare share cuda:0 (gloo: NCCL refuses two ranks on one GPU);
rank 1 SIGKILLs itself in step KILL's forward; the result must equal the
failure-free torchrun run's."""
import hashlib, os, signal, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

KILL = int(os.environ.get("KILL_STEP", "-1"))
STEPS = 30
dev = torch.device("cuda", 0)
torch.cuda.set_device(0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 1)).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)

def checksum():
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(bytes(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).tolist()))
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                h.update(bytes(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).tolist()))
    return h.hexdigest()[:16]

def train(steps):
    ddp = DDP(model, device_ids=[0])
    rank = dist.get_rank()
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=g).to(dev)
        if step == KILL and rank == 1 and os.environ.get("TP_RUN_SPARE") != "1" \
                and not os.path.exists(os.environ["OUTDIR"] + "/killed"):
            from tp_launch.resilient import parked_spares
            while parked_spares() < 1:
                time.sleep(0.05)
            open(os.environ["OUTDIR"] + "/killed", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("STEP_SLEEP"):
            time.sleep(float(os.environ["STEP_SLEEP"]))
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return checksum()

if os.environ.get("PLAIN"):
    dist.init_process_group("gloo")
    c = train(range(STEPS))
else:
    from tp_launch import resilient
    state = resilient.State(model=model, optimizer=opt)
    c = resilient.run(lambda s: train(s.steps(STEPS)), state, backend="gloo")
print(f"FINAL rank {dist.get_rank()} pid {os.getpid()} {c}", flush=True)
dist.destroy_process_group()
