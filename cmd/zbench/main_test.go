package main

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/gozt/gozt/bench"
	"github.com/gozt/gozt/internal/leaktest"
)

func TestPidList(t *testing.T) {
	var p pidList
	self := strconv.Itoa(os.Getpid())
	if err := p.Set("a=12," + self); err != nil {
		t.Fatal(err)
	}
	if err := p.Set("b=34"); err != nil {
		t.Fatal(err)
	}
	if len(p) != 3 || p[0] != (bench.Proc{Name: "a", PID: 12}) || p[1].PID != os.Getpid() || p[1].Name == "" || p[2].Name != "b" {
		t.Errorf("parsed %+v", p)
	}
	for _, bad := range []string{"x", "a=", "a=-1", ""} {
		if err := new(pidList).Set(bad); err == nil {
			t.Errorf("Set(%q) accepted", bad)
		}
	}
}

func TestScenarioCommandAgainstServe(t *testing.T) {
	leaktest.Check(t)
	srv, err := bench.Listen("127.0.0.1:0", bench.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	out := filepath.Join(t.TempDir(), "out")
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = f
	err = run(context.Background(), []string{"pingpong", "--target", srv.Addr().String(), "--count", "5", "--json"})
	os.Stdout = stdout
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(out)
	if len(b) == 0 || b[0] != '{' {
		t.Errorf("--json printed %q", b)
	}
	if err := run(context.Background(), []string{"pingpong"}); err == nil {
		t.Error("a scenario without --target ran")
	}
	if err := run(context.Background(), []string{"nope"}); err == nil {
		t.Error("an unknown command ran")
	}
}

func TestServeStopsOnCancel(t *testing.T) {
	leaktest.Check(t)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := run(ctx, []string{"serve", "--listen", "127.0.0.1:0"}); err != nil {
		t.Fatal(err)
	}
}
