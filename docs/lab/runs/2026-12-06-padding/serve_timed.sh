# The server under 8 streaming clients with its batch loop timed (serve_timed.py): bash serve_timed.sh B REQUESTS
# from a checkout root (WT: another checkout), POL: the policy (default quality).
src="$(cd "$(dirname "$0")" && pwd)"; cd ${WT:-.}; source launch/env.sh
B=${1:-8}; R=${2:-60}
PYTHONPATH=$PWD python $src/serve_timed.py --model_dir=ckpts/demo --port=18777 --policy=${POL:-quality} --link=native --warm_prompt_tokens=16 --max_batch=$B --max_queue=32 2>/tmp/serve_timed.log &
SP=$!
for i in $(seq 120); do curl -s localhost:18777/health | grep -q ok && break; sleep 1; done
python - $R <<'PY'
import http.client, json, threading, time, sys
R=int(sys.argv[1])
P=("def fibonacci(n):", "import os\n\n\ndef read_config(path):", "class Stack:\n", "def quicksort(xs):")
def client(c):
  conn=http.client.HTTPConnection("127.0.0.1",18777,timeout=600)
  for r in range(R):
    body=json.dumps(dict(model="demo",prompt=P[(c+r)%4],temperature=0,stream=True,max_tokens=32)).encode()
    conn.request("POST","/v1/completions",body=body,headers={"Content-Type":"application/json"})
    x=conn.getresponse(); x.read()
ts=[threading.Thread(target=client,args=(c,)) for c in range(8)]
t0=time.time(); [t.start() for t in ts]; [t.join() for t in ts]; dt=time.time()-t0; print("load %.2f s  %.0f tok/s"%(dt, 8*R*32/dt))
PY
kill -USR1 $SP; sleep 1; kill $SP; wait $SP 2>/dev/null
grep -A12 "^steps" /tmp/serve_timed.log
