import json, glob, sys, statistics as S
d=sys.argv[1]
rows={1:[],8:[]}
for f in sorted(glob.glob(d+'/c*-*.json')):
    c=int(f.split('/')[-1].split('-')[0][1:])
    j=json.load(open(f)); a=j['arms']
    e,p=a['engine']['gbps'],a['pread']['gbps']
    ref=max(j['ceiling_gbps'] or 0, j['fio_gbps'] or 0)
    rows[c].append((e,p,j['ceiling_gbps'],j['fio_gbps'],e/p,e/ref,p/ref, a['engine']['cpu_s_per_gb'], a['pread']['cpu_s_per_gb']))
    print(c, *['%.3f'%x for x in rows[c][-1]])
def q(xs,p):
    xs=sorted(xs); k=(len(xs)-1)*p; i=int(k); return xs[i]+(xs[min(i+1,len(xs)-1)]-xs[i])*(k-i)
for c in (1,8):
    r=rows[c]
    if not r: continue
    for i,name in [(4,'engine/pread'),(5,'engine/max'),(6,'pread/max'),(7,'engine cpu'),(8,'pread cpu')]:
        xs=[x[i] for x in r]
        print('c%d %-13s median %.3f p20-p80 %.3f-%.3f min-max %.3f-%.3f n=%d'%(c,name,S.median(xs),q(xs,.2),q(xs,.8),min(xs),max(xs),len(xs)))
