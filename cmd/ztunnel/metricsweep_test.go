package main

import (
	"testing"

	"github.com/gozt/gozt/xds/state"
)

// goneFrom answers for the label values the proxy writes: a workload's workload name,
// else its name; a workload removed from the store is gone; a pair not asked about is not.
func TestGoneFrom(t *testing.T) {
	store := state.NewStore()
	store.Apply(&state.Batch{Workloads: []*state.Workload{
		{UID: "u1", Name: "web-7f9c-abcde", WorkloadMeta: &state.WorkloadMeta{WorkloadName: "web", Namespace: "default"}},
		{UID: "u2", Name: "job-123-xyz", WorkloadMeta: &state.WorkloadMeta{Namespace: "batch"}},
	}})
	cases := []struct {
		ns, w string
		want  bool
	}{
		{"default", "web", false},
		{"default", "web-7f9c-abcde", false},
		{"batch", "job-123-xyz", false},
		{"batch", "web", true},
		{"default", "job-124-abc", true},
	}
	asked := map[nsName]bool{}
	for _, tc := range cases {
		asked[nsName{tc.ns, tc.w}] = false
	}
	gone := goneFrom(store, asked)
	if gone("other", "never-asked") {
		t.Error("a pair not asked about is gone")
	}
	for _, tc := range cases {
		if got := gone(tc.ns, tc.w); got != tc.want {
			t.Errorf("gone(%q, %q) = %v, want %v", tc.ns, tc.w, got, tc.want)
		}
	}
	store.Apply(&state.Batch{RemoveAddresses: []string{"u2"}})
	if !goneFrom(store, map[nsName]bool{{"batch", "job-123-xyz"}: false})("batch", "job-123-xyz") {
		t.Error("a workload removed from the store is not gone")
	}
}
