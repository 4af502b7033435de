// Package xdspb holds our wire-compatible copies of Istio's ambient xDS protos and the type
// URLs ztunnel subscribes to. The generated Go lives in workloadpb (istio.workload) and
// securitypb (istio.security); two Go packages because both proto packages define an Address
// and an Extension message. discoverypb holds the delta ADS subset of Envoy's
// envoy.service.discovery.v3 (and envoy.config.core.v3.Node) with its gRPC stubs, so the
// client need not link go-control-plane. It owns no logic: conversion to plain Go types is
// done by package xds.
//
// Regenerate with `make proto` (protoc from Debian's protobuf-compiler, protoc-gen-go v1.36.12,
// protoc-gen-go-grpc v1.5.1); `make proto-check` fails when the checked-in code is stale.
package xdspb

// Type URLs of the delta ADS resources ztunnel consumes.
const (
	AddressType       = "type.googleapis.com/istio.workload.Address"
	AuthorizationType = "type.googleapis.com/istio.security.Authorization"
)
