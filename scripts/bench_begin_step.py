"""Host-side cost of ``ProducerRuntime.begin_step`` per engine step (CPU only; no vLLM, no GPU).

    python scripts/bench_begin_step.py

256 decoding requests (Llama-3-8B geometry) with one spec each: HS 1 layer, steering 1 layer, steering all
layers. begin_step runs on the engine thread before every forward, so its time adds to every step
(an 8B decode step of 256 requests is ~11.6 ms on an H200).
"""
import time, numpy as np, torch
from mia_stream.producer._runtime import ProducerRuntime, StepBatch, RuntimeConfig
from mia_stream.producer.spec import ModelGeometry, parse_spec
class P:
    producer_id="p"; epoch=1
    def next_seq(s,sid): return 0
    def publish(s,m): pass
geo=ModelGeometry(32,4096,32,8,128)
v=np.ones(4096).tolist()
specs={"hs1":{"capture":{"hidden_states":{"layers":[16],"positions":"all"}}},
"steer1":{"steer":[{"layer":16,"op":"add","vector":v,"scale":0.5}]},
"steer_all":{"steer":[{"layer":i,"op":"add","vector":v,"scale":0.1} for i in range(32)]}}
for name,raw in specs.items():
    rt=ProducerRuntime(geo=geo,model_name="m",tokenizer="t",dtype=torch.bfloat16,device=torch.device("cpu"),max_tokens=8192,tp_rank=0,tp_size=1,dp_rank=0,publisher=P(),cfg=RuntimeConfig(aperture_rows=2048,capture_qk=False))
    spec=parse_spec(raw,geo)
    ids=[f"r{i}" for i in range(256)]
    for i in ids: rt.add_request(i,i,spec,list(range(64)))
    ts=[]
    for step in range(20):
        b=StepBatch(step=step,req_ids=ids,query_start=np.arange(257),num_computed=np.full(256,64+step),num_tokens=256,token_ids=np.zeros(256,np.int64))
        t=time.perf_counter(); rt.begin_step(b); ts.append(time.perf_counter()-t); rt._step_segments=None
    print(name, "begin_step ms median", round(np.median(ts)*1e3,2))
