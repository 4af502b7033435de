package state

import (
	"fmt"
	"maps"
	"net/netip"
	"runtime"
	"strconv"
	"testing"
	"time"
)

// genBatch builds n workloads spread over n/100 services (100 endpoints each), like a
// cluster's initial push.
func genBatch(n int) *Batch {
	b := &Batch{Workloads: make([]*Workload, n)}
	nsvc := max(n/100, 1)
	for i := range nsvc {
		b.Services = append(b.Services, &Service{
			Name: "svc" + strconv.Itoa(i), Namespace: "ns" + strconv.Itoa(i%50),
			Hostname:  "svc" + strconv.Itoa(i) + ".ns" + strconv.Itoa(i%50) + ".svc.cluster.local",
			Addresses: []NetworkAddress{{Address: netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})}},
			Ports:     map[uint16]uint16{80: 8080},
		})
	}
	for i := range n {
		s := b.Services[i%nsvc]
		b.Workloads[i] = &Workload{
			UID:  "Kubernetes//v1/Pod/" + s.Namespace + "/pod-" + strconv.Itoa(i),
			Name: "pod-" + strconv.Itoa(i), Node: "node-" + strconv.Itoa(i%500),
			Addresses: []netip.Addr{netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})},
			Healthy:   true, Capacity: 1,
			WorkloadMeta: &WorkloadMeta{
				Namespace: s.Namespace, Protocol: TunnelHBONE, TrustDomain: "cluster.local",
				ServiceAccount: "sa" + strconv.Itoa(i%1000), ClusterID: "Kubernetes",
				Services: map[string]map[uint16]uint16{s.Key(): {80: 8080}},
			},
		}
		b.Workloads[i].CacheIdentity() // as the xDS converter does
	}
	return b
}

func BenchmarkApply(b *testing.B) {
	for _, n := range []int{10_000, 100_000} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			batch := genBatch(n)
			b.ReportAllocs()
			for b.Loop() {
				s := NewStore()
				s.Apply(batch)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/workload")
		})
	}
}

// BenchmarkApplyIncremental is one small push (10 updated workloads) into a 100k store: the
// cost a reader can be blocked behind.
func BenchmarkApplyIncremental(b *testing.B) {
	batch := genBatch(100_000)
	s := NewStore()
	s.Apply(batch)
	upd := &Batch{Workloads: batch.Workloads[:10]}
	b.ReportAllocs()
	for b.Loop() {
		s.Apply(upd)
	}
}

func BenchmarkLookup(b *testing.B) {
	s := NewStore()
	s.Apply(genBatch(100_000))
	b.Run("ByIP-100k", func(b *testing.B) {
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i = (i + 7919) % 100_000
			if s.WorkloadByIP("", netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})) == nil {
				b.Fatal("miss")
			}
		}
	})
	b.Run("ByVIP-100k", func(b *testing.B) {
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i++
			if s.ServiceByVIP("", netip.AddrFrom4([4]byte{10, 96, byte(i % 1000 >> 8), byte(i % 1000)}), "ns1") == nil {
				b.Fatal("miss")
			}
		}
	})
	b.Run("Resolve-100k", func(b *testing.B) {
		src := s.WorkloadByIP("", netip.AddrFrom4([4]byte{10, 0, 0, 1}))
		dst := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 96, 0, 7}), 80)
		b.ReportAllocs()
		for b.Loop() {
			if _, err := s.Resolve(src, dst); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("ByIP-parallel-during-pushes", func(b *testing.B) {
		stop := make(chan struct{})
		done := make(chan struct{})
		upd := genBatch(1000)
		go func() { // the pusher: small pushes back to back
			defer close(done)
			for {
				select {
				case <-stop:
					return
				default:
					s.Apply(&Batch{Workloads: upd.Workloads[:10]})
				}
			}
		}()
		b.RunParallel(func(pb *testing.PB) {
			i := 0
			for pb.Next() {
				i++
				s.WorkloadByIP("", netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}))
			}
		})
		close(stop)
		<-done
	})
}

// BenchmarkMemory reports the heap held by a store of 10k workloads (plus 100 services),
// including the converted values themselves.
func BenchmarkMemory(b *testing.B) {
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		s := NewStore()
		s.Apply(genBatch(10_000))
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/(1<<20), "MiB/10k-workloads")
		runtime.KeepAlive(s)
	}
}

// BenchmarkSnapshotCloneCost is the floor of the alternative design (ARCHITECTURE.md open
// question 2): an immutable snapshot swapped atomically must copy at least the IP, uid and
// name indexes on every push. Compare with BenchmarkApplyIncremental (same 100k store).
func BenchmarkSnapshotCloneCost(b *testing.B) {
	s := NewStore()
	s.Apply(genBatch(100_000))
	b.ReportAllocs()
	for b.Loop() {
		s.mu.RLock()
		a, w := s.idx.byAddr.clone(nil), maps.Clone(s.idx.workloads)
		n := make(map[string]map[string]*Workload, len(s.idx.byName))
		for ns, m := range s.idx.byName {
			n[ns] = maps.Clone(m)
		}
		s.mu.RUnlock()
		runtime.KeepAlive(a)
		runtime.KeepAlive(w)
		runtime.KeepAlive(n)
	}
}

// BenchmarkLookupParallel is the RunParallel baseline for ByIP-parallel-during-pushes.
func BenchmarkLookupParallel(b *testing.B) {
	s := NewStore()
	s.Apply(genBatch(100_000))
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			i++
			s.WorkloadByIP("", netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}))
		}
	})
}

// BenchmarkReaderWaitDuringPush reports the longest a WorkloadByIP call took while a 100k
// push was applied in another goroutine: into a small store (swapped in, or with
// everything in place under one lock) and into a store holding all 100k (a resync, in
// place in slices).
func BenchmarkReaderWaitDuringPush(b *testing.B) {
	batch := genBatch(100_000)
	for _, mode := range []struct {
		name string
		big  int
		held int
	}{{"swap", bigBatch, 1000}, {"in-place", 1 << 30, 1000}, {"resync", bigBatch, 100_000}} {
		b.Run(mode.name, func(b *testing.B) {
			defer func(old int) { bigBatch = old }(bigBatch)
			bigBatch = mode.big
			for b.Loop() {
				s := NewStore()
				s.Apply(genBatch(mode.held))
				done := make(chan struct{})
				go func() { defer close(done); s.Apply(batch) }()
				var worst time.Duration
				slow := 0
				a := netip.AddrFrom4([4]byte{10, 0, 0, 5})
			loop:
				for {
					select {
					case <-done:
						break loop
					default:
					}
					t0 := time.Now()
					s.WorkloadByIP("", a)
					d := time.Since(t0)
					worst = max(worst, d)
					if d > time.Millisecond {
						slow++
					}
				}
				b.ReportMetric(float64(worst.Microseconds()), "max-wait-µs")
				b.ReportMetric(float64(slow), "lookups>1ms")
			}
		})
	}
}
