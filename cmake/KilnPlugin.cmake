# kiln_add_plugin(<target> SOURCES <src>... [TEMPLATES <dir>] [TEMPLATE_DEPENDS <file>...]
#                 [OUTPUT_NAME <name>])
#
# Builds a family plugin (docs/plugins.md): a shared library (lib<OUTPUT_NAME>.so, default
# lib<target>.so) that links kiln's family SDK (kiln::family_sdk) with hidden visibility, embeds
# every *.cuh file under TEMPLATES as kiln::plugin_templates() (kiln/embedded_templates.h), and
# exports only kiln_plugin_entry. The templates are globbed when TEMPLATE_DEPENDS is not given.
# Comes with find_package(kiln), and is included by kiln's own build for its example plugin.
function(kiln_add_plugin target)
  cmake_parse_arguments(P "" "TEMPLATES;OUTPUT_NAME" "SOURCES;TEMPLATE_DEPENDS" ${ARGN})
  set(here ${CMAKE_CURRENT_FUNCTION_LIST_DIR})  # embed_templates.cmake and kiln_plugin.map are beside this file
  if(NOT P_SOURCES)
    message(FATAL_ERROR "kiln_add_plugin(${target}): SOURCES is required")
  endif()
  set(sources ${P_SOURCES})
  if(P_TEMPLATES)
    get_filename_component(templates ${P_TEMPLATES} ABSOLUTE)
    set(depends ${P_TEMPLATE_DEPENDS})
    if(NOT depends)
      file(GLOB_RECURSE depends CONFIGURE_DEPENDS ${templates}/*.cuh)
    endif()
    set(embedded ${CMAKE_CURRENT_BINARY_DIR}/${target}_templates.cpp)
    add_custom_command(
      OUTPUT ${embedded}
      COMMAND ${CMAKE_COMMAND} -DROOT=${templates} -DOUT=${embedded}
              -P ${here}/embed_templates.cmake
      DEPENDS ${depends} ${here}/embed_templates.cmake
      COMMENT "Embedding the templates of ${target}")
    list(APPEND sources ${embedded})
  endif()
  add_library(${target} MODULE ${sources})
  target_link_libraries(${target} PRIVATE kiln::family_sdk)
  set_target_properties(${target} PROPERTIES CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON PREFIX "lib")
  if(P_OUTPUT_NAME)
    set_target_properties(${target} PROPERTIES OUTPUT_NAME ${P_OUTPUT_NAME})
  endif()
  # Undefined symbols fail the link, not the dlopen; only the entry point is exported (template
  # instantiations of std:: types would otherwise be, with default visibility). libstdc++ and
  # libgcc are linked in, so the plugin loads into kiln's statically linked binaries and into
  # processes that bring another libstdc++.
  target_link_options(${target} PRIVATE -Wl,--no-undefined -Wl,--exclude-libs,ALL
                      -Wl,--version-script=${here}/kiln_plugin.map
                      -static-libstdc++ -static-libgcc)
  set_target_properties(${target} PROPERTIES LINK_DEPENDS ${here}/kiln_plugin.map)
endfunction()
