package testutil

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Metrics are metric families by name, from a registry (Gather) or a scraped page
// (ParseMetrics).
type Metrics map[string]*dto.MetricFamily

// Gather reads g, failing tb if it cannot.
func Gather(tb testing.TB, g prometheus.Gatherer) Metrics {
	tb.Helper()
	fams, err := g.Gather()
	if err != nil {
		tb.Fatalf("gather: %v", err)
	}
	m := make(Metrics, len(fams))
	for _, f := range fams {
		m[f.GetName()] = f
	}
	return m
}

// ParseMetrics reads a page in the Prometheus text format (/metrics), failing tb if it
// cannot.
func ParseMetrics(tb testing.TB, text string) Metrics {
	tb.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(text))
	if err != nil {
		tb.Fatalf("parse metrics: %v", err)
	}
	return fams
}

// Sum adds up the counter, gauge and untyped samples of family name whose labels include
// every pair of want, and says how many series matched.
func (m Metrics) Sum(name string, want map[string]string) (sum float64, series int) {
next:
	for _, s := range m[name].GetMetric() {
		for k, v := range want {
			if label(s, k) != v {
				continue next
			}
		}
		series++
		sum += s.GetCounter().GetValue() + s.GetGauge().GetValue() + s.GetUntyped().GetValue()
	}
	return sum, series
}

func label(s *dto.Metric, name string) string {
	for _, lp := range s.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}
