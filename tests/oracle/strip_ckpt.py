import sys, torch
s = torch.load(sys.argv[1], map_location='cpu', weights_only=False)
print('keys', list(s.keys()))
out = {k: s[k] for k in ['args', 'model', 'extra_state', 'optimizer_history']}
torch.save(out, sys.argv[2])
print({k: (v.shape, v.dtype) for k, v in out['model'].items()})
print('params', sum(v.numel() for k, v in out['model'].items() if v.dtype.is_floating_point))
