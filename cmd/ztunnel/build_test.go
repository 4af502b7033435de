package main

import (
	"os/exec"
	"strings"
	"testing"
)

// buildTags are the tags make build uses (Makefile TAGS).
const buildTags = "grpcnotrace"

// The shipped binary links no text/template: its reflect MethodByName call makes the
// linker keep every exported method of every reachable type (2.9 MB of code, about 2 MiB
// of RSS per node). gRPC's x/net/trace brought it in until grpcnotrace left that out; a
// new dependency could bring it back.
func TestBuildLinksNoTemplates(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("the go tool is not on PATH")
	}
	out, err := exec.Command(goTool, "list", "-deps", "-tags", buildTags, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if pkg == "text/template" || pkg == "html/template" {
			t.Errorf("ztunnel (tags %s) imports %s; find who with: go list -deps -tags %s -f '{{.ImportPath}}: {{.Imports}}' ./cmd/ztunnel | grep template", buildTags, pkg, buildTags)
		}
	}
}
