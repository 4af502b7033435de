package testutil

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
)

func TestEventuallyWaits(t *testing.T) {
	var n atomic.Int32
	Eventually(t, "three polls", func() bool { return n.Add(1) >= 3 })
	if n.Load() != 3 {
		t.Errorf("cond called %d times, want 3", n.Load())
	}
	n.Store(0)
	EventuallyNil(t, func() error {
		if n.Add(1) < 3 {
			return errors.New("not yet")
		}
		return nil
	})
	if n.Load() != 3 {
		t.Errorf("check called %d times, want 3", n.Load())
	}
}

func TestPollReturnsLastError(t *testing.T) {
	var n atomic.Int32
	err := Poll(30*time.Millisecond, func() error {
		n.Add(1)
		return errors.New("never")
	})
	if err == nil || err.Error() != "never" || n.Load() < 2 {
		t.Errorf("Poll = %v after %d checks; want the check's error after more than one", err, n.Load())
	}
	if err := Poll(time.Hour, func() error { return nil }); err != nil {
		t.Errorf("Poll of a check that holds = %v", err)
	}
}

func TestMetricsSum(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c_total", Help: "h"}, []string{"a", "b"})
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "g", Help: "h"})
	reg.MustRegister(c, g)
	c.WithLabelValues("x", "1").Add(2)
	c.WithLabelValues("x", "2").Add(3)
	c.WithLabelValues("y", "1").Add(5)
	g.Set(7)
	var page strings.Builder
	fams, _ := reg.Gather()
	for _, f := range fams {
		if _, err := expfmt.MetricFamilyToText(&page, f); err != nil {
			t.Fatal(err)
		}
	}
	for name, m := range map[string]Metrics{"gathered": Gather(t, reg), "parsed": ParseMetrics(t, page.String())} {
		for _, tc := range []struct {
			family string
			want   map[string]string
			sum    float64
			series int
		}{
			{"c_total", nil, 10, 3},
			{"c_total", map[string]string{"a": "x"}, 5, 2},
			{"c_total", map[string]string{"a": "x", "b": "1"}, 2, 1},
			{"c_total", map[string]string{"c": "x"}, 0, 0},
			{"g", nil, 7, 1},
			{"missing", nil, 0, 0},
		} {
			if sum, n := m.Sum(tc.family, tc.want); sum != tc.sum || n != tc.series {
				t.Errorf("%s: Sum(%s, %v) = %v over %d series; want %v over %d", name, tc.family, tc.want, sum, n, tc.sum, tc.series)
			}
		}
	}
}
