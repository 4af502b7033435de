package ca

import (
	"context"
	"fmt"
	"testing"

	"github.com/gozt/gozt/internal/istiogrpc"
)

func TestNewSelectsProvider(t *testing.T) {
	sock := "unix://" + t.TempDir() + "/agent.sock" // never dialed: the client connects lazily
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Config: istiogrpc.Config{RootCA: "SYSTEM"}}, "*ca.istioClient"},
		{Config{SpiffeSocket: sock}, "*ca.spiffeClient"},
		{Config{SpiffeSocket: sock, LocalXDS: true}, "*ca.spiffeClient"},
		{Config{LocalXDS: true, Dir: t.TempDir()}, "*ca.Builtin"},
		{Config{LocalXDS: true, Config: istiogrpc.Config{Address: "http://127.0.0.1:1"}}, "*ca.istioClient"},
		{Config{Provider: "builtin", Config: istiogrpc.Config{Address: "http://127.0.0.1:1"}, Dir: t.TempDir()}, "*ca.Builtin"},
		{Config{Provider: "istio", SpiffeSocket: sock, Config: istiogrpc.Config{RootCA: "SYSTEM"}}, "*ca.istioClient"},
	} {
		c, err := New(context.Background(), tc.cfg)
		if err != nil {
			t.Errorf("New(%+v): %v", tc.cfg, err)
			continue
		}
		if got := fmt.Sprintf("%T", c); got != tc.want {
			t.Errorf("New(%+v) = %s; want %s", tc.cfg, got, tc.want)
		}
		if err := c.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if err := c.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	}
}
