import sys,re,collections
# per step: the largest reduce_scatter wait of each rank (end of backward)
for f in sys.argv[1:]:
    L=[l.split() for l in open(f) if ' WAIT ' in l]
    per={0:[],1:[]}; cur={0:0.0,1:0.0}
    for t in L:
        r=int(t[3]); op=t[4]; ms=float(t[5])
        if op=='reduce_scatter': cur[r]=max(cur[r],ms)
        if op=='all_reduce' and cur[r]>0: per[r].append(cur[r]); cur[r]=0
    print(f, 'r0', ' '.join('%.0f'%x for x in per[0])); print(f, 'r1', ' '.join('%.0f'%x for x in per[1]))
