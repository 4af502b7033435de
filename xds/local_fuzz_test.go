package xds

import (
	"os"
	"testing"

	"github.com/gozt/gozt/xds/state"
)

// FuzzParseLocal feeds arbitrary bytes to the local YAML config parser: it must not panic,
// and a file it accepts must apply to a store.
func FuzzParseLocal(f *testing.F) {
	for _, name := range []string{"../examples/two-nodes.yaml", "../examples/localhost.yaml"} {
		if b, err := os.ReadFile(name); err == nil {
			f.Add(b)
		}
	}
	f.Add([]byte("workloads:\n  - uid: x\n    workloadIps: [\"::1\", \"bad\"]\n"))
	f.Add([]byte("policies: [{name: p, scope: Global, rules: [[{matches: [{principals: [{exact: a}]}]}]]}]"))
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := ParseFile("fuzz.yaml", data)
		if err != nil {
			return
		}
		state.NewStore().Apply(b)
	})
}
